/* A connected tenant that makes contexts around the interposer: after the honest start (its
 * primary context reserved, 64 MiB through the hooked symbol) it takes glibc's own `dlsym`
 * through `dlvsym` (the interposer hooks `dlsym`, not `dlvsym`), resolves the real
 * `cuCtxCreate_v2` and makes argv[1] contexts nobody reserved. Three of them (900 MiB on a card
 * charging 300 MiB each) take a 1 GiB allocation past its limit plus the backstop's slack, but
 * not past the old 512 MiB-per-process tolerance. It prints "escaped <CUresult>" (the first
 * failure, or 0) and waits 10 s: the backstop should kill it long before. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "escape_client.h"

typedef CUresult (*create_t)(CUcontext *, unsigned int, CUdevice);
CUresult cuCtxCreate_v2(CUcontext *, unsigned int, CUdevice);

int main(int argc, char **argv) {
    int n = argc > 1 ? atoi(argv[1]) : 3;
    hooked_start();
    glibc_dlsym_t real_dlsym = glibc_dlsym();
    void *cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    create_t real_create = (real_dlsym && cuda) ? (create_t)real_dlsym(cuda, "cuCtxCreate_v2") : NULL;
    if (!real_create || real_create == cuCtxCreate_v2) {
        fprintf(stderr, "could not reach the real cuCtxCreate_v2\n");
        return 1;
    }
    CUresult r = 0;
    for (int i = 0; i < n && r == 0; i++) {
        CUcontext c;
        r = real_create(&c, 0, 0);
    }
    printf("escaped %d\n", r);
    fflush(stdout);
    sleep(10);
    return 0;
}
