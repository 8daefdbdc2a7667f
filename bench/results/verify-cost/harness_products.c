#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <omp.h>
#include "kenspec.h"
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
typedef struct { long out, k; uint16_t *w; } prod;
int main(int argc, char **argv){
  int threads = argc > 1 ? atoi(argv[1]) : 1;
  omp_set_num_threads(threads);
  long shapes[4][2] = {{960,576},{576,576},{3072,576},{576,1536}};
  prod p[120]; size_t bytes=0;
  for(int l=0;l<30;l++) for(int s=0;s<4;s++){
    prod *q=&p[l*4+s]; q->out=shapes[s][0]; q->k=shapes[s][1];
    q->w=aligned_alloc(64, q->out*q->k*2); 
    for(long i=0;i<q->out*q->k;i++) q->w[i]=0x3c00 + (rand()&0xff);
    bytes+=q->out*q->k*2;
  }
  uint16_t *x=aligned_alloc(64, 256*3072*2), *y=aligned_alloc(64, 256*3072*2);
  for(long i=0;i<256*3072;i++) x[i]=0x3f00+(rand()&0x7f);
  int rowsv[] = {1,2,3,4,6,8,12,16,17,32,64,128};
  for(int ri=0; ri<12; ri++){
    int rows=rowsv[ri]; double best=1e9;
    for(int rep=0;rep<12;rep++){
      double t=now();
      for(int i=0;i<120;i++) kenspec_gemv_bf16(x,p[i].w,y,rows,p[i].k,p[i].out);
      double dt=now()-t; if(rep>1 && dt<best) best=dt;
    }
    printf("threads %d rows %3d: %7.2f ms  %5.1f GB/s  %5.2f dpbf16/ns\n", threads, rows, best*1e3, bytes/best/1e9, bytes/2.0*rows/32/best/1e9);
  }
}
