/* Max pooling and its gradient (pool.c: the row loops for the windows inside the input,
 * the general loop for the rest) against naive loops, on random geometries: planes 1-3,
 * maps 1-40 a side, windows 1-5 a side, strides 1-3, padding up to half the window,
 * dilation 1-2, ceil_mode on and off, small integer values (ties in most windows). The
 * forward must equal the first maximum of each window exactly, the gradient the sums of
 * the output gradient at those maxima in window order. Prints "ok <cases>" and exits 0,
 * or names each case that differs and exits 1. tests/test_c_pool.py builds it with the
 * backend's flags, portably and with the address and undefined-behaviour sanitizers. */
#include <stdio.h>
#include <stdlib.h>
#include <math.h>
#include "pe_kernels.h"
static unsigned s_ = 7; static int rnd(int n){ s_ = s_*1103515245u+12345u; return (int)((s_>>8)%(unsigned)n); }
/* the first maximum of each window in row-major tap order, padded taps skipped */
static void ref(const float*x,const float*gy,float*y,float*gx,const long*g){
  long P=g[0],H=g[2],W=g[3],KH=g[5],KW=g[6],OH=g[7],OW=g[8],sh=g[9],sw=g[10],ph=g[11],pw=g[12],dh=g[13],dw=g[14];
  for(long i=0;i<P*H*W;i++)gx[i]=0;
  for(long p=0;p<P;p++)for(long a=0;a<OH;a++)for(long b=0;b<OW;b++){long best=-1; float top=0;
    for(long i=0;i<KH;i++)for(long j=0;j<KW;j++){long r=a*sh-ph+i*dh,q=b*sw-pw+j*dw; if(r<0||r>=H||q<0||q>=W)continue;
      float v=x[(p*H+r)*W+q]; if(best<0||v>top){best=(p*H+r)*W+q;top=v;}}
    y[(p*OH+a)*OW+b]=best<0?-INFINITY:top; if(best>=0)gx[best]+=gy[(p*OH+a)*OW+b];}
}
int main(void){
  int cases=0,bad=0;
  for(int it=0;it<400;it++){
    long P=1+rnd(3),H=1+rnd(40),W=1+rnd(40),KH=1+rnd(5),KW=1+rnd(5),sh=1+rnd(3),sw=1+rnd(3);
    long ph=rnd(KH/2+1),pw=rnd(KW/2+1),dh=1+rnd(2)*(it%4==0),dw=1+rnd(2)*(it%4==0),ceil=rnd(2);
    long eh=dh*(KH-1)+1,ew=dw*(KW-1)+1; if(H+2*ph<eh||W+2*pw<ew)continue;
    long OH=(H+2*ph-eh+(ceil?sh-1:0))/sh+1,OW=(W+2*pw-ew+(ceil?sw-1:0))/sw+1;
    if(ceil){ if((OH-1)*sh>=H+ph)OH--; if((OW-1)*sw>=W+pw)OW--; } /* ATen: no window starts in the right padding */
    long g[PE_G_LEN]={P,1,H,W,1,KH,KW,OH,OW,sh,sw,ph,pw,dh,dw,1,0,0};
    long nx=P*H*W,ny=P*OH*OW;
    float*x=malloc(sizeof(float)*nx),*y=malloc(sizeof(float)*ny),*y2=malloc(sizeof(float)*ny),*gy=malloc(sizeof(float)*ny),*gx=malloc(sizeof(float)*nx),*gx2=malloc(sizeof(float)*nx);
    for(long i=0;i<nx;i++)x[i]=(float)(rnd(5)-2); for(long i=0;i<ny;i++)gy[i]=(float)(1+rnd(8));
    ref(x,gy,y2,gx2,g); pe_max_pool2d_f32(x,y,g); pe_max_pool2d_grad_f32(gy,x,gx,g);
    int off=0; for(long i=0;i<ny;i++)if(y[i]!=y2[i])off=1; for(long i=0;i<nx;i++)if(gx[i]!=gx2[i])off=1;
    if(off){bad=1;printf("off P%ld H%ld W%ld K%ldx%ld s%ld,%ld p%ld,%ld d%ld,%ld ceil%ld\n",P,H,W,KH,KW,sh,sw,ph,pw,dh,dw,ceil);}
    cases++; free(x);free(y);free(y2);free(gy);free(gx);free(gx2);
  }
  if(bad)return 1;
  printf("ok %d\n",cases); return 0;
}
