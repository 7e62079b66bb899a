/* The CUDA driver and NVML types the test clients use, written out (the test machines have no
 * CUDA headers); layouts as in cuda.h and nvml.h of CUDA 12. One copy for every client. */
#ifndef TESSERA_TEST_CUDA_ABI_H
#define TESSERA_TEST_CUDA_ABI_H

typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext, *CUmodule, *CUfunction, *CUstream;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;

typedef struct {
    int type; /* CU_MEM_LOCATION_TYPE_DEVICE = 1 */
    int id;
} CUmemLocation;
typedef struct {
    int type; /* CU_MEM_ALLOCATION_TYPE_PINNED = 1 */
    int requestedHandleTypes; /* CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1 */
    CUmemLocation location;
    void *win32HandleMetaData;
    unsigned char compressionType, gpuDirectRDMACapable;
    unsigned short usage;
    unsigned char reserved[4];
} CUmemAllocationProp;
typedef struct {
    CUmemLocation location;
    int flags; /* CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3 */
} CUmemAccessDesc;

/* nvmlMemory_t */
typedef struct {
    unsigned long long total, free, used;
} nvml_memory_t;
typedef int (*nvml_init_t)(void);
typedef int (*nvml_handle_t)(unsigned int, void **);
typedef int (*nvml_meminfo_t)(void *, nvml_memory_t *);

#endif
