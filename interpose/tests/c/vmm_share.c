/* Shared VMM memory passed between two processes over a Unix socket (SCM_RIGHTS), through the
 * hooked symbols. Two roles, each its own process (a CUDA context does not survive fork):
 *
 *   vmm_share export PATH ROUNDS MIB   listens on PATH; each round cuMemCreate(MIB) with a POSIX
 *                                      fd handle type, cuMemExportToShareableHandle, sends the fd,
 *                                      waits for the importer's ack, then cuMemRelease (never
 *                                      mapped) and closes its fd; prints "released <round> <rc>".
 *   vmm_share import PATH ROUNDS MIB   connects to PATH; each round receives the fd,
 *                                      cuMemImportFromShareableHandle, and when that succeeds
 *                                      reserves, maps and grants access to MIB; prints
 *                                      "round <round> <import rc> <map rc>" (map rc -1 when not
 *                                      tried), closes the fd, acks.
 *
 * Both print "done" after the last round and then wait (mappings in place) until stdin closes,
 * so the test can look at the card and the arbiter. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>
#include "cuda_abi.h"

CUresult cuInit(unsigned int);
CUresult cuDeviceGet(CUdevice *, int);
CUresult cuDevicePrimaryCtxRetain(CUcontext *, CUdevice);
CUresult cuCtxSetCurrent(CUcontext);
CUresult cuMemCreate(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *, unsigned long long);
CUresult cuMemExportToShareableHandle(void *, CUmemGenericAllocationHandle, int, unsigned long long);
CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *, void *, int);
CUresult cuMemAddressReserve(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
CUresult cuMemMap(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
CUresult cuMemSetAccess(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);
CUresult cuMemRelease(CUmemGenericAllocationHandle);

static void send_fd(int sock, int fd) {
    char byte = 'f';
    struct iovec iov = {&byte, 1};
    char ctl[CMSG_SPACE(sizeof(int))];
    memset(ctl, 0, sizeof ctl);
    struct msghdr msg = {0};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = ctl;
    msg.msg_controllen = sizeof ctl;
    struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(c), &fd, sizeof(int));
    if (sendmsg(sock, &msg, 0) != 1) {
        perror("sendmsg");
        exit(1);
    }
}

static int recv_fd(int sock) {
    char byte;
    struct iovec iov = {&byte, 1};
    char ctl[CMSG_SPACE(sizeof(int))];
    struct msghdr msg = {0};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = ctl;
    msg.msg_controllen = sizeof ctl;
    if (recvmsg(sock, &msg, 0) != 1) {
        perror("recvmsg");
        exit(1);
    }
    struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
    if (!c || c->cmsg_type != SCM_RIGHTS) {
        fprintf(stderr, "no descriptor\n");
        exit(1);
    }
    int fd;
    memcpy(&fd, CMSG_DATA(c), sizeof(int));
    return fd;
}

int main(int argc, char **argv) {
    if (argc != 5) {
        fprintf(stderr, "usage: vmm_share export|import PATH ROUNDS MIB\n");
        return 2;
    }
    int exporter = strcmp(argv[1], "export") == 0;
    int rounds = atoi(argv[3]);
    size_t size = strtoull(argv[4], NULL, 10) << 20;
    CUdevice dev;
    CUcontext ctx;
    if (cuInit(0) || cuDeviceGet(&dev, 0) || cuDevicePrimaryCtxRetain(&ctx, dev) || cuCtxSetCurrent(ctx)) {
        fprintf(stderr, "no context\n");
        return 1;
    }
    struct sockaddr_un addr = {0};
    addr.sun_family = AF_UNIX;
    strncpy(addr.sun_path, argv[2], sizeof addr.sun_path - 1);
    int sock = socket(AF_UNIX, SOCK_STREAM, 0);
    if (exporter) {
        int l = sock;
        if (bind(l, (struct sockaddr *)&addr, sizeof addr) || listen(l, 1)) {
            perror("listen");
            return 1;
        }
        printf("listening\n");
        fflush(stdout);
        sock = accept(l, NULL, NULL);
    } else if (connect(sock, (struct sockaddr *)&addr, sizeof addr)) {
        perror("connect");
        return 1;
    }
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof prop);
    prop.type = 1;
    prop.requestedHandleTypes = 1;
    prop.location.type = 1;
    prop.location.id = dev;
    CUmemAccessDesc access = {{1, dev}, 3};
    for (int i = 0; i < rounds; i++) {
        char ack;
        if (exporter) {
            CUmemGenericAllocationHandle h;
            int fd = -1;
            CUresult rc = cuMemCreate(&h, size, &prop, 0);
            if (!rc)
                rc = cuMemExportToShareableHandle(&fd, h, 1, 0);
            if (rc) {
                fprintf(stderr, "round %d: create/export failed with %d\n", i, rc);
                return 1;
            }
            send_fd(sock, fd);
            if (read(sock, &ack, 1) != 1)
                return 1;
            printf("released %d %d\n", i, cuMemRelease(h));
            close(fd);
        } else {
            int fd = recv_fd(sock);
            CUmemGenericAllocationHandle h;
            CUresult rc = cuMemImportFromShareableHandle(&h, (void *)(long)fd, 1), mapped = -1;
            if (!rc) {
                CUdeviceptr va;
                mapped = cuMemAddressReserve(&va, size, 0, 0, 0);
                if (!mapped)
                    mapped = cuMemMap(va, size, 0, h, 0);
                if (!mapped)
                    mapped = cuMemSetAccess(va, size, &access, 1);
            }
            printf("round %d %d %d\n", i, rc, mapped);
            close(fd);
            if (write(sock, "a", 1) != 1)
                return 1;
        }
        fflush(stdout);
    }
    printf("done\n");
    fflush(stdout);
    char buf[16];
    while (read(0, buf, sizeof buf) > 0) {
    }
    return 0;
}
