// Calls the CUDA driver checkpoint API directly on another process and times each call: the first look at
// real hardware behaviour, independent of gpu-checkpoint's own bindings (not part of the tool).
//
//   ckpt_probe PID ACTION...     ACTION: state | lock[:MS] | checkpoint | restore | unlock | tid
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <stdint.h>
#include <time.h>

typedef int CUresult;
typedef CUresult (*fn_pid_ptr)(int, void *);
typedef CUresult (*fn_int)(unsigned);
typedef CUresult (*fn_intp)(int *);
typedef CUresult (*fn_str)(CUresult, const char **);

static double now_ms(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec * 1e3 + t.tv_nsec / 1e6; }

int main(int argc, char **argv) {
  if (argc < 3) { fprintf(stderr, "usage: %s PID ACTION...\n", argv[0]); return 2; }
  int pid = atoi(argv[1]);
  double t0 = now_ms();
  void *lib = dlopen("libcuda.so.1", RTLD_NOW);
  if (!lib) { printf("dlopen failed: %s\n", dlerror()); return 1; }
  double t1 = now_ms();
  fn_intp ver = (fn_intp)dlsym(lib, "cuDriverGetVersion");
  fn_int init = (fn_int)dlsym(lib, "cuInit");
  fn_str errname = (fn_str)dlsym(lib, "cuGetErrorName");
  int v = 0; ver(&v);
  double t2 = now_ms();
  CUresult ri = init(0);
  double t3 = now_ms();
  printf("dlopen %.2f ms, driver version %d, cuInit=%d %.2f ms\n", t1 - t0, v, ri, t3 - t2);
  const char *names[] = {"cuCheckpointProcessGetState", "cuCheckpointProcessLock", "cuCheckpointProcessCheckpoint",
                         "cuCheckpointProcessRestore", "cuCheckpointProcessUnlock", "cuCheckpointProcessGetRestoreThreadId"};
  void *fns[6];
  for (int i = 0; i < 6; i++) { fns[i] = dlsym(lib, names[i]); printf("  %s: %s\n", names[i], fns[i] ? "found" : "MISSING"); }
  for (int a = 2; a < argc; a++) {
    unsigned char args[64];
    memset(args, 0, sizeof args);
    int out = -1;
    CUresult r;
    double s = now_ms();
    if (!strcmp(argv[a], "state")) r = ((fn_pid_ptr)fns[0])(pid, &out);
    else if (!strncmp(argv[a], "lock", 4)) {
      uint32_t ms = argv[a][4] == ':' ? (uint32_t)atoi(argv[a] + 5) : 0;
      memcpy(args, &ms, 4);
      r = ((fn_pid_ptr)fns[1])(pid, args);
    } else if (!strcmp(argv[a], "checkpoint")) r = ((fn_pid_ptr)fns[2])(pid, args);
    else if (!strcmp(argv[a], "restore")) r = ((fn_pid_ptr)fns[3])(pid, args);
    else if (!strcmp(argv[a], "unlock")) r = ((fn_pid_ptr)fns[4])(pid, args);
    else if (!strcmp(argv[a], "tid")) r = ((fn_pid_ptr)fns[5])(pid, &out);
    else { printf("unknown action %s\n", argv[a]); return 2; }
    double e = now_ms();
    const char *nm = "?";
    if (errname) errname(r, &nm);
    printf("%-12s -> %d (%s) out=%d  %.2f ms\n", argv[a], r, nm, out, e - s);
    fflush(stdout);
  }
  return 0;
}
