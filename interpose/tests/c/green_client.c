/* Green contexts (CUDA 12.4) count like contexts. Usage: green_client N.
 * Makes up to N green contexts from device 0's SMs (cuDeviceGetDevResource,
 * cuDevResourceGenerateDesc), in turn through the linked cuGreenCtxCreate and through
 * cuGetProcAddress("cuGreenCtxCreate", 12040) ("green <i> <rc>", stopping at the first failure),
 * says which object answered the second route ("routes gpa=..."), prints "ready" and holds them
 * until stdin closes; then destroys them ("destroyed <n> <first failure or 0>"). Always exits 0. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "cuda_abi.h"

typedef void *CUgreenCtx;
typedef void *CUdevResourceDesc;
typedef struct {
    int type;
    unsigned char padding[92];
    unsigned int sm_count;
    unsigned char oversize[44];
} CUdevResource;

CUresult cuInit(unsigned int);
CUresult cuDeviceGet(CUdevice *, int);
CUresult cuDeviceGetDevResource(CUdevice, CUdevResource *, int);
CUresult cuDevResourceGenerateDesc(CUdevResourceDesc *, CUdevResource *, unsigned int);
CUresult cuGreenCtxCreate(CUgreenCtx *, CUdevResourceDesc, CUdevice, unsigned int);
CUresult cuGreenCtxDestroy(CUgreenCtx);
CUresult cuGetProcAddress_v2(const char *, void **, int, unsigned long long, int *);

typedef CUresult (*create_t)(CUgreenCtx *, CUdevResourceDesc, CUdevice, unsigned int);

static const char *owner(void *p) {
    Dl_info info;
    if (!p) return "null";
    if (!dladdr(p, &info) || !info.dli_fname) return "unknown";
    return strstr(info.dli_fname, "tessera_interpose") ? "interposer" : "driver";
}

int main(int argc, char **argv) {
    int want = argc > 1 ? atoi(argv[1]) : 1;
    setvbuf(stdout, NULL, _IOLBF, 0);
    CUdevice dev = 0;
    CUdevResource sms;
    CUdevResourceDesc desc = NULL;
    memset(&sms, 0, sizeof sms);
    CUresult r = cuInit(0);
    if (r == 0) r = cuDeviceGet(&dev, 0);
    if (r == 0) r = cuDeviceGetDevResource(dev, &sms, 1 /* CU_DEV_RESOURCE_TYPE_SM */);
    if (r == 0) r = cuDevResourceGenerateDesc(&desc, &sms, 1);
    printf("desc %d\n", r);
    void *gpa = NULL;
    int status = -1;
    cuGetProcAddress_v2("cuGreenCtxCreate", &gpa, 12040, 0, &status);
    printf("routes gpa=%s\n", owner(gpa));

    CUgreenCtx *made = calloc(want > 0 ? want : 1, sizeof(CUgreenCtx));
    int n = 0;
    for (int i = 0; r == 0 && i < want; i++) {
        CUgreenCtx c = NULL;
        CUresult g = i % 2 == 0 || !gpa ? cuGreenCtxCreate(&c, desc, dev, 1)
                                        : ((create_t)gpa)(&c, desc, dev, 1);
        printf("green %d %d\n", i, g);
        if (g != 0) break;
        made[n++] = c;
    }
    printf("ready\n");

    char line[128];
    while (fgets(line, sizeof line, stdin)) {
    }
    CUresult first = 0;
    for (int i = 0; i < n; i++) {
        CUresult d = cuGreenCtxDestroy(made[i]);
        if (d != 0 && first == 0) first = d;
    }
    printf("destroyed %d %d\n", n, first);
    return 0;
}
