#!/bin/bash
# Keep the benchmark (descendants of $1) on CPU 0 and every other user process on CPU 1.
root=$1
while kill -0 $root 2>/dev/null; do
  mine=$(ps -eo pid,ppid | awk -v r=$root 'NR>1{p[$1]=$2} END{for(x in p){y=x; while(y>1){if(y==r){print x; break} y=p[y]}} print r}')
  for pid in $(ps -eo pid,comm | awk 'NR>1 && $1>500 && $2 ~ /python|pytest|cc1|gcc|ld|make|cmake|lmplz|build_binary|ninja|c\+\+|as$/ {print $1}'); do
    if echo "$mine" | grep -qx $pid; then taskset -a -p 1 $pid >/dev/null 2>&1; else taskset -a -p 2 $pid >/dev/null 2>&1; fi
  done
  sleep 1
done
