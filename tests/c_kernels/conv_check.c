/* The depthwise (whole-plane and row) and Winograd convolution kernels against naive
 * loops in double on random geometries: depthwise with filters 1-5 a side, strides 1-3,
 * dilations 1-2, padding up to the filter's size, maps 1-40 a side; Winograd 3x3 with
 * 1-40 channels in and out, padding 0-3 (the input gradient then pads by 2 - p, down to
 * -1), maps 1-12 (F(2x2, 3x3) and F(4x4, 3x3), forward, input gradient and F(4x4)'s
 * weight gradient); the implicit GEMM's input gradient (col2im where strided) on dense and
 * grouped geometries with filters 1-7 a side, strides 1-3 and dilations 1-2; then fixed
 * depthwise geometries (maps up to 97 a side, on the row
 * kernels, and MobileNetV2's) and Winograd ones of up to 147 tiles. Prints "ok <cases>"
 * and exits 0, or names each case off by more than 1e-5 of its largest value (3e-5 for
 * F(4x4, 3x3)) and exits 1. tests/test_c_conv.py builds it with the
 * backend's flags, portably, with the address and undefined-behaviour sanitizers, and for
 * aarch64 (run under qemu). */
#include <stdio.h>
#include <stdlib.h>
#include <math.h>
#include "pe_kernels.h"
static unsigned s_ = 1; static int rnd(int n){ s_ = s_*1103515245u+12345u; return (int)((s_>>8)%(unsigned)n); }
static float* alloc(size_t n){ float*p=malloc((n?n:1)*sizeof(float)); for(size_t i=0;i<n;i++) p[i]=(float)rnd(2000)/1000.f-1.f; return p; }
static void ref_fwd(const float*x,const float*w,float*y,const long*g){
  long N=g[0],C=g[1],H=g[2],W=g[3],O=g[4],KH=g[5],KW=g[6],OH=g[7],OW=g[8],sh=g[9],sw=g[10],ph=g[11],pw=g[12],dh=g[13],dw=g[14],G=g[15];
  long cg=C/G,og=O/G;
  for(long n=0;n<N;n++)for(long o=0;o<O;o++)for(long a=0;a<OH;a++)for(long b=0;b<OW;b++){double s=0;
    for(long c=0;c<cg;c++)for(long i=0;i<KH;i++)for(long j=0;j<KW;j++){long r=a*sh-ph+i*dh,q=b*sw-pw+j*dw; if(r<0||r>=H||q<0||q>=W)continue;
      s+=(double)x[((n*C+o/og*cg+c)*H+r)*W+q]*w[((o*cg+c)*KH+i)*KW+j];}
    y[((n*O+o)*OH+a)*OW+b]=(float)s;}
}
static void ref_igrad(const float*gy,const float*w,float*gx,const long*g){
  long N=g[0],C=g[1],H=g[2],W=g[3],O=g[4],KH=g[5],KW=g[6],OH=g[7],OW=g[8],sh=g[9],sw=g[10],ph=g[11],pw=g[12],dh=g[13],dw=g[14],G=g[15];
  long cg=C/G,og=O/G; for(long i=0;i<N*C*H*W;i++)gx[i]=0;
  for(long n=0;n<N;n++)for(long o=0;o<O;o++)for(long a=0;a<OH;a++)for(long b=0;b<OW;b++)
    for(long c=0;c<cg;c++)for(long i=0;i<KH;i++)for(long j=0;j<KW;j++){long r=a*sh-ph+i*dh,q=b*sw-pw+j*dw; if(r<0||r>=H||q<0||q>=W)continue;
      gx[((n*C+o/og*cg+c)*H+r)*W+q]+=gy[((n*O+o)*OH+a)*OW+b]*w[((o*cg+c)*KH+i)*KW+j];}
}
static void ref_wgrad(const float*x,const float*gy,float*gw,const long*g){
  long N=g[0],C=g[1],H=g[2],W=g[3],O=g[4],KH=g[5],KW=g[6],OH=g[7],OW=g[8],sh=g[9],sw=g[10],ph=g[11],pw=g[12],dh=g[13],dw=g[14],G=g[15];
  long cg=C/G,og=O/G;
  for(long o=0;o<O;o++)for(long c=0;c<cg;c++)for(long i=0;i<KH;i++)for(long j=0;j<KW;j++){double s=0;
    for(long n=0;n<N;n++)for(long a=0;a<OH;a++)for(long b=0;b<OW;b++){long r=a*sh-ph+i*dh,q=b*sw-pw+j*dw; if(r<0||r>=H||q<0||q>=W)continue;
      s+=(double)gy[((n*O+o)*OH+a)*OW+b]*x[((n*C+o/og*cg+c)*H+r)*W+q];}
    gw[((o*cg+c)*KH+i)*KW+j]=(float)s;}
}
#define WINO4_TOL 3e-5
static double err(const float*a,const float*b,long n){double e=0,m=1;for(long i=0;i<n;i++){double d=fabs(a[i]-b[i]);if(d>e)e=d;if(fabs(b[i])>m)m=fabs(b[i]);}return e/m;}
/* One geometry against the references; returns 1 when off. */
static int check(const long*g,int wino,double*worst){
  long N=g[0],C=g[1],H=g[2],W=g[3],O=g[4],K=g[5],KW=g[6],OH=g[7],OW=g[8],s=g[9],sw=g[10],p=g[11],pw=g[12],d=g[13],dw=g[14],G=g[15];
  long nx=N*C*H*W, ny=N*O*OH*OW, nw=O*(C/G)*K*KW; int bad=0;
  float*x=alloc(nx),*w=alloc(nw),*gy=alloc(ny),*y=alloc(ny),*y2=alloc(ny),*gx=alloc(nx),*gx2=alloc(nx),*gw=alloc(nw),*gw2=alloc(nw);
  ref_fwd(x,w,y2,g); ref_igrad(gy,w,gx2,g); ref_wgrad(x,gy,gw2,g);
  if(wino==1){ pe_conv2d_winograd_f32(x,w,NULL,y,g); pe_conv2d_input_grad_winograd_f32(gy,w,gx,g);
    double e1=err(y,y2,ny),e2=err(gx,gx2,nx); if(e1>worst[3])worst[3]=e1; if(e2>worst[4])worst[4]=e2;
    if(e1>1e-5||e2>1e-5) bad=1, printf("winograd off %ld %ld %ld %ld %ld p%ld,%ld: %g %g\n",N,C,O,H,W,p,pw,e1,e2);
    long nwork=pe_winograd4_work(0,g), n1=pe_winograd4_work(1,g), n2=pe_winograd4_work(2,g);
    if(n1>nwork)nwork=n1; if(n2>nwork)nwork=n2;
    float*work=malloc((size_t)nwork*sizeof(float));
    pe_conv2d_winograd4_f32(x,w,NULL,y,g,work); pe_conv2d_input_grad_winograd4_f32(gy,w,gx,g,work);
    pe_conv2d_weight_grad_winograd4_f32(x,gy,gw,g,work); free(work);
    e1=err(y,y2,ny),e2=err(gx,gx2,nx); double e3=err(gw,gw2,nw);
    if(e1>worst[5])worst[5]=e1; if(e2>worst[6])worst[6]=e2; if(e3>worst[7])worst[7]=e3;
    if(e1>WINO4_TOL||e2>WINO4_TOL||e3>WINO4_TOL) bad=1, printf("winograd4 off %ld %ld %ld %ld %ld p%ld,%ld: %g %g %g\n",N,C,O,H,W,p,pw,e1,e2,e3);
  } else if(wino==2){ /* the implicit GEMM's input gradient: col2im where strided */
    pe_conv2d_input_grad_im2col_f32(gy,w,gx,g);
    double e2=err(gx,gx2,nx); if(e2>worst[8])worst[8]=e2;
    if(e2>1e-5) bad=1, printf("im2col input grad off N%ld C%ld O%ld G%ld H%ld W%ld K%ldx%ld s%ld,%ld p%ld,%ld d%ld,%ld: %g\n",N,C,O,G,H,W,K,KW,s,sw,p,pw,d,dw,e2);
  } else {
    pe_depthwise_f32(x,w,NULL,y,g); pe_depthwise_input_grad_f32(gy,w,gx,g); pe_depthwise_weight_grad_f32(x,gy,gw,g);
    double e1=err(y,y2,ny),e2=err(gx,gx2,nx),e3=err(gw,gw2,nw); if(e1>worst[0])worst[0]=e1; if(e2>worst[1])worst[1]=e2; if(e3>worst[2])worst[2]=e3;
    if(e1>1e-5||e2>1e-5||e3>1e-5) bad=1, printf("depthwise off N%ld C%ld H%ld W%ld K%ldx%ld s%ld,%ld p%ld,%ld d%ld,%ld: %g %g %g\n",N,C,H,W,K,KW,s,sw,p,pw,d,dw,e1,e2,e3);
  }
  free(x);free(w);free(gy);free(y);free(y2);free(gx);free(gx2);free(gw);free(gw2);
  return bad;
}
/* Depthwise geometries the random ones miss: maps of 62-97 a side, whose input gradient
 * takes the row kernels (stride 2: their two phases woven back, either parity of padding),
 * MobileNetV2's (3x3, padding 1, strides 1 and 2; 8x8 and 4x4 maps of many channels on the
 * whole-plane kernels), paddings 0-2, odd sizes, and 5x5 filters.
 * N, C, H, W, K, stride, padding. */
static const long FIXED[][7]={
  {2,8,64,64,3,2,1},{1,5,65,65,3,2,1},{1,4,64,63,3,2,0},{1,3,63,66,3,2,2},{1,3,97,70,5,2,2},
  {1,2,66,64,5,2,1},{1,3,64,64,3,3,1},{1,3,70,68,3,1,1},{1,4,64,64,3,1,1},{2,96,8,8,3,1,1},
  {1,576,8,8,3,1,1},{1,160,7,7,3,1,1},{2,240,4,4,3,1,1},{1,144,16,16,3,2,1},{1,32,15,17,3,2,1},
  {1,24,9,9,3,2,0},{1,24,32,32,3,2,1},{1,16,33,31,3,2,2},{1,8,40,40,5,2,2},{1,12,12,12,3,3,1}};
/* Winograd geometries of many tiles (several blocks of 32 tiles, whose weight gradient sums
 * across blocks), padding 0-2, cut tiles: N, C, O, H, W, padding. */
static const long FIXED_WINO[][6]={
  {2,20,36,18,15,1},{3,5,7,30,29,0},{1,33,65,17,17,2},{4,8,8,16,16,1},{1,3,40,23,9,1}};
int main(void){
  double worst[9]={0};
  int cases = 0, bad = 0;
  for(int it=0;it<240;it++){
    int wino = it%2;
    long N=1+rnd(3),H=1+rnd(wino?12:40),W=1+rnd(wino?12:40),K=wino?3:1+rnd(5),KW=wino?3:1+rnd(5),s=wino?1:1+rnd(3),sw=wino?1:1+rnd(3),d=wino?1:1+rnd(2),dw=wino?1:1+rnd(2);
    long p=rnd(K+1),pw=rnd(KW+1);
    long C = wino? 1+rnd(40):1+rnd(6), O = wino? 1+rnd(40): C, G = wino?1:C;
    long OH=(H+2*p-d*(K-1)-1)/s+1, OW=(W+2*pw-dw*(KW-1)-1)/sw+1;
    if(OH<1||OW<1||H+2*p<d*(K-1)+1||W+2*pw<dw*(KW-1)+1) continue;
    cases++;
    long g[PE_G_LEN]={N,C,H,W,O,K,KW,OH,OW,s,sw,p,pw,d,dw,G,0,0};
    bad|=check(g,wino,worst);
  }
  /* dense and grouped input gradients, strides 1-3 (col2im blocks: up to 40 channels of
   * up to 7x7 taps, up to 900 positions) */
  for(int it=0;it<80;it++){
    long G=1+rnd(2),N=1+rnd(2),H=1+rnd(30),W=1+rnd(30),K=1+rnd(7),KW=1+rnd(7),s=1+rnd(3),sw=1+rnd(3),d=1+rnd(2),dw=1+rnd(2);
    long p=rnd(K+1),pw=rnd(KW+1),C=G*(1+rnd(20)),O=G*(1+rnd(12));
    long OH=(H+2*p-d*(K-1)-1)/s+1, OW=(W+2*pw-dw*(KW-1)-1)/sw+1;
    if(OH<1||OW<1||H+2*p<d*(K-1)+1||W+2*pw<dw*(KW-1)+1) continue;
    cases++;
    long g[PE_G_LEN]={N,C,H,W,O,K,KW,OH,OW,s,sw,p,pw,d,dw,G,0,0};
    bad|=check(g,2,worst);
  }
  for(size_t i=0;i<sizeof(FIXED)/sizeof(FIXED[0]);i++){
    const long*f=FIXED[i]; long N=f[0],C=f[1],H=f[2],W=f[3],K=f[4],s=f[5],p=f[6];
    long g[PE_G_LEN]={N,C,H,W,C,K,K,(H+2*p-K)/s+1,(W+2*p-K)/s+1,s,s,p,p,1,1,C,0,0};
    cases++;
    bad|=check(g,0,worst);
  }
  for(size_t i=0;i<sizeof(FIXED_WINO)/sizeof(FIXED_WINO[0]);i++){
    const long*f=FIXED_WINO[i]; long p=f[5];
    long g[PE_G_LEN]={f[0],f[1],f[3],f[4],f[2],3,3,f[3]+2*p-2,f[4]+2*p-2,1,1,p,p,1,1,1,0,0};
    cases++;
    bad|=check(g,1,worst);
  }
  if (bad) return 1;
  printf("ok %d worst: depthwise %.1e %.1e %.1e, winograd %.1e %.1e, winograd4 %.1e %.1e %.1e, "
         "im2col input grad %.1e\n", cases, worst[0], worst[1], worst[2], worst[3], worst[4],
         worst[5], worst[6], worst[7], worst[8]);
  return 0;
}
