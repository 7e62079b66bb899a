/* A connected tenant that launches kernels around the lease gate: it allocates 1 MiB through
 * the hooked symbol (which connects it to the arbiter), then takes glibc's own `dlsym` through
 * `dlvsym` and resolves the real `cuLaunchKernel` with it. It launches argv[2]-µs `spin`
 * kernels back to back for argv[1] seconds, a handful in flight at a time, never asking for a
 * lease. Prints "bypassing" once it starts and "done <launches>" at the end (the backstop should
 * kill it long before). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "spin_client.h"

CUresult cuMemAlloc_v2(CUdeviceptr *, size_t);
CUresult cuLaunchKernel(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream,
                        void **, void **);
CUresult cuStreamSynchronize(CUstream);

typedef void *(*dlsym_t)(void *, const char *);
typedef CUresult (*launch_t)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                             CUstream, void **, void **);

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec / 1e9;
}

int main(int argc, char **argv) {
    double seconds = argc > 1 ? atof(argv[1]) : 10;
    unsigned long long ns = (argc > 2 ? strtoull(argv[2], NULL, 10) : 1000) * 1000ull;
    CUcontext ctx;
    CUfunction fn;
    CUdeviceptr p;
    if (spin_setup(&ctx, &fn) || cuMemAlloc_v2(&p, 1 << 20)) {
        fprintf(stderr, "no context\n");
        return 1;
    }
    void *libc = dlopen("libc.so.6", RTLD_NOW | RTLD_NOLOAD);
    dlsym_t real_dlsym = libc ? (dlsym_t)dlvsym(libc, "dlsym", "GLIBC_2.34") : NULL;
    if (!real_dlsym && libc)
        real_dlsym = (dlsym_t)dlvsym(libc, "dlsym", "GLIBC_2.2.5");
    void *cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    launch_t real_launch = (real_dlsym && cuda) ? (launch_t)real_dlsym(cuda, "cuLaunchKernel") : NULL;
    if (!real_launch || real_launch == cuLaunchKernel) {
        fprintf(stderr, "could not reach the real cuLaunchKernel\n");
        return 1;
    }
    printf("bypassing\n");
    fflush(stdout);
    long launches = 0;
    double end = now() + seconds;
    while (now() < end) {
        for (int i = 0; i < 4; i++) {
            void *params[] = {&ns};
            if (real_launch(fn, 1, 1, 1, 1, 1, 1, 0, NULL, params, NULL))
                return 2;
            launches++;
        }
        cuStreamSynchronize(NULL);
    }
    printf("done %ld\n", launches);
    return 0;
}
