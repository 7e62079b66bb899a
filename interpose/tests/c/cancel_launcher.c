/* Cancels launching threads while they wait for a compute lease. Each round starts a thread
 * that launches kernels (cuLaunchKernel, 1 ms each on the simulated GPU) forever, with a
 * pthread_testcancel() after each launch; after a while the main thread cancels and joins it.
 * Another tenant keeps the GPU busy, so the thread spends much of its time waiting for a lease:
 * a cancellation must wait for the launch to return, never unwind through the interposer.
 * Usage: cancel_launcher ROUNDS MS_BEFORE_CANCEL; prints one JSON line. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "spin_client.h"

CUresult cuLaunchKernel(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                        CUstream, void **, void **);

static CUcontext ctx;
static CUfunction fn;
static long launches;

static void *launcher(void *arg) {
    (void)arg;
    unsigned long long ns = 1000000;
    void *params[] = {&ns};
    cuCtxSetCurrent(ctx);
    for (;;) {
        if (cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, NULL, params, NULL) == 0)
            __atomic_add_fetch(&launches, 1, __ATOMIC_RELAXED);
        pthread_testcancel();
    }
    return NULL;
}

int main(int argc, char **argv) {
    int rounds = atoi(argv[1]);
    long ms = atol(argv[2]);
    if (spin_setup(&ctx, &fn)) {
        printf("{\"error\": \"setup\"}\n");
        return 1;
    }
    int cancelled = 0;
    for (int i = 0; i < rounds; i++) {
        pthread_t t;
        if (pthread_create(&t, NULL, launcher, NULL)) {
            printf("{\"error\": \"pthread_create\"}\n");
            return 1;
        }
        /* Vary the moment so some cancellations land while the thread waits for a grant. */
        struct timespec d = {0, (ms + 7 * i) * 1000000L};
        nanosleep(&d, NULL);
        pthread_cancel(t);
        void *res;
        pthread_join(t, &res);
        cancelled += res == PTHREAD_CANCELED;
    }
    cuCtxSynchronize();
    printf("{\"rounds\": %d, \"cancelled\": %d, \"launches\": %ld}\n", rounds, cancelled, launches);
    return 0;
}
