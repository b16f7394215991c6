/* Stand-in for the NVIDIA driver library (libcuda.so.1) on machines without a GPU.
 * SGLang's CUDA build of sgl_kernel is imported at module level even on CPU, and its shared objects link
 * against libcuda.so.1. Every entry point answers CUDA_ERROR_NO_DEVICE (100). Tests only; never shipped. */
typedef int CUresult;
#define NO_DEVICE 100
CUresult cuInit(unsigned int flags) { (void)flags; return NO_DEVICE; }
CUresult cuDriverGetVersion(int *v) { if (v) *v = 0; return NO_DEVICE; }
CUresult cuDeviceGetCount(int *c) { if (c) *c = 0; return NO_DEVICE; }
CUresult cuGetProcAddress(const char *s, void **p, int v, unsigned long long f) {
  (void)s; (void)v; (void)f; if (p) *p = 0; return NO_DEVICE; }
CUresult cuGetProcAddress_v2(const char *s, void **p, int v, unsigned long long f, void *st) {
  (void)s; (void)v; (void)f; (void)st; if (p) *p = 0; return NO_DEVICE; }
CUresult cuPointerGetAttribute(void *d, int a, unsigned long long p) { (void)d; (void)a; (void)p; return NO_DEVICE; }
