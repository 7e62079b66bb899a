/* A library (not preloaded) that wraps getppid and reaches libc's through dlsym(RTLD_NEXT).
 * RTLD_NEXT is relative to the caller: if a dlsym interposer answered it relative to itself,
 * this library would find its own getppid again and recurse (detected, returns -2). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <unistd.h>

static int depth;

pid_t getppid(void) {
    if (depth > 4) return -2;
    depth++;
    pid_t (*next)(void) = (pid_t (*)(void))dlsym(RTLD_NEXT, "getppid");
    pid_t r = next ? next() : -1;
    depth--;
    return r;
}
