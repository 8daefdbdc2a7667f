/* The AVX2 4-bit GEMV's quad loop for 4 pass rows as GCC 12 compiles the intrinsics (before
 * 4032b95): gcc -O3 -mavx2 -mfma -o quad_intrinsics quad_intrinsics.c && ./quad_intrinsics */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <stdint.h>
#include <immintrin.h>
static double now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
#define RB 4
int main(){
  long k=576, blocks=8; /* 1024 outputs */
  uint8_t *q=aligned_alloc(64,blocks*k*8); for(long i=0;i<blocks*k*8;i++)q[i]=rand();
  int8_t *x=aligned_alloc(64,RB*k); for(long i=0;i<RB*k;i++)x[i]=rand()%127;
  __m256i out[2*RB]; for(int j=0;j<2*RB;j++)out[j]=_mm256_setzero_si256();
  const __m256i nibble=_mm256_set1_epi8(15);
  long n=16000; double best=1e9;
  for(int rep=0;rep<10;rep++){double a=now();
  for(long it=0;it<n;it++)
  for(long b=0;b<blocks;b++){ __asm__ volatile("" ::: "memory");const uint8_t*at=q+b*k*8;
    __m256i acc[2*RB]; for(int j=0;j<2*RB;j++)acc[j]=_mm256_setzero_si256();
    for(long i=0;i<k;i+=4,at+=32){
      const __m256i bytes=_mm256_loadu_si256((const __m256i*)at);
      const __m256i low=_mm256_and_si256(bytes,nibble);
      const __m256i high=_mm256_and_si256(_mm256_srli_epi16(bytes,4),nibble);
      for(int j=0;j<RB;j++){int32_t four; memcpy(&four,x+j*k+i,4);
        const __m256i xs=_mm256_set1_epi32(four);
        acc[2*j]=_mm256_add_epi16(acc[2*j],_mm256_maddubs_epi16(low,xs));
        acc[2*j+1]=_mm256_add_epi16(acc[2*j+1],_mm256_maddubs_epi16(high,xs));}
    }
    for(int j=0;j<2*RB;j++)out[j]=_mm256_add_epi16(out[j],acc[j]);
  }
  double t=(now()-a)/n; if(t<best)best=t;}
  int32_t o[8];__m256i tot=out[0];for(int j=1;j<2*RB;j++)tot=_mm256_add_epi16(tot,out[j]);_mm256_storeu_si256((__m256i*)o,tot);
  double macs=blocks*16.0*k*RB;
  printf("RB %d: %.2f us, %.1f GMAC/s, %.1f MAC/cycle@2.9 (%d)\n",RB,best*1e6,macs/best*1e-9,macs/best*1e-9/2.9,o[0]);
}
