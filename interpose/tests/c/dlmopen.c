/* A connected tenant that goes around the interposer with a second link-map namespace: it
 * allocates 64 MiB through the (hooked) linked symbol, which connects it to the arbiter, then
 * loads a second copy of the driver with dlmopen(LM_ID_NEWLM, "libcuda.so.1", RTLD_NOW) (the
 * interposer is preloaded into the base namespace only), takes that namespace's own dlsym (from
 * its copy of libc) and through it cuInit, cuDeviceGet, cuDevicePrimaryCtxRetain,
 * cuCtxSetCurrent and cuMemAlloc_v2, and allocates argv[1] MiB with them. It prints
 * "hooked <CUresult>", "escaped <CUresult>" and waits 10 s (the backstop should kill it long
 * before). With DLMOPEN_FIRST set it skips the hooked allocation: its first act is the dlmopen,
 * so it never connects (it prints no "hooked" line). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <link.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "escape_client.h"

typedef void *(*dlsym_t)(void *, const char *);

int main(int argc, char **argv) {
    size_t mib = argc > 1 ? strtoull(argv[1], NULL, 10) : 4096;
    CUdeviceptr big;
    if (!getenv("DLMOPEN_FIRST"))
        hooked_start();
    void *ns = dlmopen(LM_ID_NEWLM, "libcuda.so.1", RTLD_NOW);
    if (!ns) {
        fprintf(stderr, "dlmopen: %s\n", dlerror());
        return 1;
    }
    /* Which objects the new namespace holds: the interposer must not be among them. */
    struct link_map *map = NULL;
    if (dlinfo(ns, RTLD_DI_LINKMAP, &map) == 0) {
        while (map && map->l_prev)
            map = map->l_prev;
        for (; map; map = map->l_next)
            if (strstr(map->l_name, "tessera_interpose"))
                fprintf(stderr, "the interposer is in the new namespace: %s\n", map->l_name);
    }
    /* "dlsym" is no hooked name: this is the new namespace's libc's own dlsym. */
    dlsym_t ns_dlsym = (dlsym_t)dlsym(ns, "dlsym");
    if (!ns_dlsym) {
        fprintf(stderr, "no dlsym in the new namespace\n");
        return 1;
    }
    CUresult (*init)(unsigned int) = ns_dlsym(ns, "cuInit");
    CUresult (*device_get)(CUdevice *, int) = ns_dlsym(ns, "cuDeviceGet");
    CUresult (*retain)(CUcontext *, CUdevice) = ns_dlsym(ns, "cuDevicePrimaryCtxRetain");
    CUresult (*set_current)(CUcontext) = ns_dlsym(ns, "cuCtxSetCurrent");
    CUresult (*alloc)(CUdeviceptr *, size_t) = ns_dlsym(ns, "cuMemAlloc_v2");
    if (!init || !device_get || !retain || !set_current || !alloc || alloc == cuMemAlloc_v2) {
        fprintf(stderr, "could not reach the second driver's functions\n");
        return 1;
    }
    CUdevice dev2;
    CUcontext ctx2;
    CUresult rc = init(0);
    if (!rc)
        rc = device_get(&dev2, 0);
    if (!rc)
        rc = retain(&ctx2, dev2);
    if (!rc)
        rc = set_current(ctx2);
    if (!rc)
        rc = alloc(&big, mib << 20);
    printf("escaped %d\n", rc);
    fflush(stdout);
    sleep(10);
    return 0;
}
