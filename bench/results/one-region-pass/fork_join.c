/* An OpenMP fork and join, and a barrier, on this machine: gcc -O2 -fopenmp fork_join.c &&
 * OMP_NUM_THREADS=2 ./a.out (2-core EPYC VM, 2026-12-07: 2.21-2.38 us, 1.00-1.05 us). */
#include <stdio.h>
#include <time.h>
#include <omp.h>
static double now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
volatile int sink[64];
int main(){ for(int r=0;r<3;r++){ double a=now(); for(int i=0;i<100000;i++){
 #pragma omp parallel
 { sink[omp_get_thread_num()*16]++; }
 } double f=(now()-a)/100000*1e6;
 a=now();
 #pragma omp parallel
 { for(int i=0;i<100000;i++){ sink[omp_get_thread_num()*16]++;
 #pragma omp barrier
 } }
 printf("fork/join %.2f us, barrier %.2f us\n",f,(now()-a)/100000*1e6);}}
