// A CUDA workload for hardware checks of gpu-checkpoint (not part of the tool).
//
//   cuda_workload MODE MIB STATE_FILE [IPC_HANDLE_HEX]
//   MODE: malloc | managed | host | ipc-parent | ipc-child
//
// It keeps device memory evolving: every step adds 1 to every 32-bit word, so after step S word i must equal
// i + S. Every few steps it copies the buffer back and checks that, then writes "step S ok SUM" (or
// "MISMATCH ...") to STATE_FILE. A checkpoint/restore that loses or corrupts device memory shows up there.
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <time.h>

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e)); exit(1); } } while (0)

__global__ void init(unsigned *d, size_t n) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) d[i] = (unsigned)i;
}
__global__ void step(unsigned *d, size_t n) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) d[i] += 1;
}

static void write_state(const char *path, const char *msg) {
  char tmp[4096];
  snprintf(tmp, sizeof tmp, "%s.tmp", path);
  FILE *f = fopen(tmp, "w");
  if (!f) return;
  fputs(msg, f);
  fclose(f);
  rename(tmp, path);
}

int main(int argc, char **argv) {
  if (argc < 4) { fprintf(stderr, "usage: %s MODE MIB STATE_FILE [HANDLE]\n", argv[0]); return 2; }
  const char *mode = argv[1];
  size_t bytes = (size_t)atol(argv[2]) << 20;
  const char *state = argv[3];
  size_t n = bytes / 4;
  unsigned *d = NULL, *h = NULL;
  if (!strcmp(mode, "managed")) {
    CK(cudaMallocManaged(&d, bytes));
  } else if (!strcmp(mode, "ipc-child")) {
    cudaIpcMemHandle_t hd;
    const char *hex = argv[4];
    for (int i = 0; i < (int)sizeof hd; i++) sscanf(hex + 2 * i, "%2hhx", &((unsigned char *)&hd)[i]);
    CK(cudaIpcOpenMemHandle((void **)&d, hd, cudaIpcMemLazyEnablePeerAccess));
    char msg[256];
    snprintf(msg, sizeof msg, "ipc-child opened %p\n", (void *)d);
    write_state(state, msg);
    for (;;) sleep(1);
  } else {
    CK(cudaMalloc(&d, bytes));
  }
  if (!strcmp(mode, "host") || 1) CK(cudaMallocHost(&h, bytes < (64u << 20) ? bytes : (64u << 20)));
  init<<<1024, 256>>>(d, n);
  CK(cudaDeviceSynchronize());
  if (!strcmp(mode, "ipc-parent")) {
    cudaIpcMemHandle_t hd;
    CK(cudaIpcGetMemHandle(&hd, d));
    char hex[2 * sizeof hd + 1];
    for (int i = 0; i < (int)sizeof hd; i++) sprintf(hex + 2 * i, "%02x", ((unsigned char *)&hd)[i]);
    char path[4096];
    snprintf(path, sizeof path, "%s.handle", state);
    write_state(path, hex);
  }
  unsigned *check = (unsigned *)malloc(bytes);
  for (unsigned long s = 1;; s++) {
    step<<<1024, 256>>>(d, n);
    CK(cudaDeviceSynchronize());
    if (s % 50 == 0) {
      CK(cudaMemcpy(check, d, bytes, cudaMemcpyDeviceToHost));
      size_t bad = 0;
      unsigned long long sum = 0;
      for (size_t i = 0; i < n; i++) { if (check[i] != (unsigned)(i + s)) bad++; sum += check[i]; }
      char msg[256];
      struct timespec ts; clock_gettime(CLOCK_REALTIME, &ts);
      if (bad) snprintf(msg, sizeof msg, "MISMATCH step %lu bad %zu time %ld\n", s, bad, (long)ts.tv_sec);
      else snprintf(msg, sizeof msg, "step %lu ok sum %llu time %ld\n", s, sum, (long)ts.tv_sec);
      write_state(state, msg);
    }
    usleep(2000);
  }
}
