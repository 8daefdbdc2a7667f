/* The same loop written out as 4032b95 writes it (inline assembly, the sums in registers):
 * gcc -O3 -mavx2 -mfma -o quad_asm quad_asm.c && ./quad_asm */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <stdint.h>
#include <immintrin.h>
static double now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
int main(){
  long k=576, blocks=8;
  uint8_t *q=aligned_alloc(64,blocks*k*8); for(long i=0;i<blocks*k*8;i++)q[i]=rand();
  int8_t *x=aligned_alloc(64,4*k); for(long i=0;i<4*k;i++)x[i]=rand()%127;
  __m256i out[8]; for(int j=0;j<8;j++)out[j]=_mm256_setzero_si256();
  const __m256i nibble=_mm256_set1_epi8(15);
  long n=16000; double best=1e9;
  for(int rep=0;rep<10;rep++){double a=now();
  for(long it=0;it<n;it++)
  for(long b=0;b<blocks;b++){ __asm__ volatile("" ::: "memory");const uint8_t*at=q+b*k*8;
    __m256i a0=_mm256_setzero_si256(),a1=a0,a2=a0,a3=a0,a4=a0,a5=a0,a6=a0,a7=a0;
    const int8_t *x0=x,*x1=x+k,*x2=x+2*k,*x3=x+3*k;
    for(long i=0;i<k;i+=4,at+=32){
      __asm__(
        "vpand (%[at]), %[nib], %%ymm8\n"
        "vmovdqu (%[at]), %%ymm9\n"
        "vpsrlw $4, %%ymm9, %%ymm9\n"
        "vpand %%ymm9, %[nib], %%ymm9\n"
        "vpbroadcastd (%[x0]), %%ymm10\n"
        "vpmaddubsw %%ymm10, %%ymm8, %%ymm11\n vpaddw %%ymm11, %[a0], %[a0]\n"
        "vpmaddubsw %%ymm10, %%ymm9, %%ymm12\n vpaddw %%ymm12, %[a1], %[a1]\n"
        "vpbroadcastd (%[x1]), %%ymm10\n"
        "vpmaddubsw %%ymm10, %%ymm8, %%ymm11\n vpaddw %%ymm11, %[a2], %[a2]\n"
        "vpmaddubsw %%ymm10, %%ymm9, %%ymm12\n vpaddw %%ymm12, %[a3], %[a3]\n"
        "vpbroadcastd (%[x2]), %%ymm10\n"
        "vpmaddubsw %%ymm10, %%ymm8, %%ymm11\n vpaddw %%ymm11, %[a4], %[a4]\n"
        "vpmaddubsw %%ymm10, %%ymm9, %%ymm12\n vpaddw %%ymm12, %[a5], %[a5]\n"
        "vpbroadcastd (%[x3]), %%ymm10\n"
        "vpmaddubsw %%ymm10, %%ymm8, %%ymm11\n vpaddw %%ymm11, %[a6], %[a6]\n"
        "vpmaddubsw %%ymm10, %%ymm9, %%ymm12\n vpaddw %%ymm12, %[a7], %[a7]\n"
        : [a0]"+x"(a0),[a1]"+x"(a1),[a2]"+x"(a2),[a3]"+x"(a3),[a4]"+x"(a4),[a5]"+x"(a5),[a6]"+x"(a6),[a7]"+x"(a7)
        : [at]"r"(at),[nib]"x"(nibble),[x0]"r"(x0+i),[x1]"r"(x1+i),[x2]"r"(x2+i),[x3]"r"(x3+i)
        : "xmm8","xmm9","xmm10","xmm11","xmm12");
    }
    out[0]=_mm256_add_epi16(out[0],a0);out[1]=_mm256_add_epi16(out[1],a1);out[2]=_mm256_add_epi16(out[2],a2);out[3]=_mm256_add_epi16(out[3],a3);
    out[4]=_mm256_add_epi16(out[4],a4);out[5]=_mm256_add_epi16(out[5],a5);out[6]=_mm256_add_epi16(out[6],a6);out[7]=_mm256_add_epi16(out[7],a7);
  }
  double t=(now()-a)/n; if(t<best)best=t;}
  int32_t o[8];__m256i tot=out[0];for(int j=1;j<8;j++)tot=_mm256_add_epi16(tot,out[j]);_mm256_storeu_si256((__m256i*)o,tot);
  double macs=blocks*16.0*k*4;
  printf("asm RB4: %.2f us, %.1f GMAC/s, %.1f MAC/cycle@2.9 (%d)\n",best*1e6,macs/best*1e-9,macs/best*1e-9/2.9,o[0]);
}
