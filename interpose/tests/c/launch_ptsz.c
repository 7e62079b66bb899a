/* Launches kernels through cuLaunchKernel_ptsz, resolved with cuGetProcAddress flag 2 (per-thread
 * default stream), on stream 0 (this thread's per-thread default stream), for a given time.
 * With a third argument `sync`, waits for each kernel with cuStreamSynchronize_ptsz (resolved
 * the same way). On the simulated GPU the kernel's first parameter is the nanoseconds it runs.
 * Usage: launch_ptsz SECONDS KERNEL_MS [sync] */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "spin_client.h"

CUresult cuGetProcAddress_v2(const char *, void **, int, unsigned long long, int *);
typedef CUresult (*sync_t)(CUstream);
typedef CUresult (*launch_t)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                             unsigned, CUstream, void **, void **);

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec / 1e9;
}

int main(int argc, char **argv) {
    double seconds = atof(argv[1]);
    unsigned long long ns = (unsigned long long)(atof(argv[2]) * 1e6);
    CUcontext ctx;
    CUfunction fn;
    if (spin_setup(&ctx, &fn)) {
        printf("{\"error\": \"setup\"}\n");
        return 1;
    }
    void *p = NULL;
    int status = 0;
    if (cuGetProcAddress_v2("cuLaunchKernel", &p, 12000, 2, &status) || !p) {
        printf("{\"error\": \"cuGetProcAddress\"}\n");
        return 1;
    }
    int sync = argc > 3 && strcmp(argv[3], "sync") == 0;
    void *s = NULL;
    if (sync && (cuGetProcAddress_v2("cuStreamSynchronize", &s, 12000, 2, &status) || !s)) {
        printf("{\"error\": \"cuGetProcAddress\"}\n");
        return 1;
    }
    Dl_info info;
    const char *name = dladdr(p, &info) && info.dli_sname ? info.dli_sname : "?";
    const char *sync_name = s && dladdr(s, &info) && info.dli_sname ? info.dli_sname : "";
    void *params[] = {&ns};
    long launches = 0;
    double start = now();
    while (now() - start < seconds) {
        CUresult r = ((launch_t)p)(fn, 1, 1, 1, 32, 1, 1, 0, NULL, params, NULL);
        if (r) {
            printf("{\"error\": \"launch %d\"}\n", r);
            return 1;
        }
        launches++;
        if (sync && (r = ((sync_t)s)(NULL))) {
            printf("{\"error\": \"sync %d\"}\n", r);
            return 1;
        }
    }
    double launched_for = now() - start;
    cuCtxSynchronize();
    printf("{\"launches\": %ld, \"launched_for\": %f, \"resolved\": \"%s\", \"resolved_sync\": \"%s\"}\n",
           launches, launched_for, name, sync_name);
    return 0;
}
