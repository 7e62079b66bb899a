#define _GNU_SOURCE
#include <stdio.h>
#include <sys/syscall.h>
#include <unistd.h>

int main(void) {
    printf("wrapped=%ld\nreal=%ld\n", (long)getppid(), (long)syscall(SYS_getppid));
    return 0;
}
