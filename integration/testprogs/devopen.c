/* devopen: open(path, O_RDWR) each argv path and print the outcome.
 *
 * Prints "PATH OK" or "PATH ERRNONAME" (ENXIO, EPERM, ENOENT, EACCES, ...)
 * for each argument, and always exits 0 so that one container run can probe
 * several nodes.  The distinction matters to GPU hook tests: EPERM means the
 * devices cgroup refused the open, ENXIO means the cgroup let it through but
 * no driver is bound to the major number (no GPU on the test machine).
 *
 * It is linked statically so that it runs in any rootfs, even one whose
 * dynamic loader or libc a test has deliberately broken.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

int main(int argc, char **argv)
{
    for (int i = 1; i < argc; i++) {
        int fd = open(argv[i], O_RDWR | O_CLOEXEC);
        if (fd >= 0) {
            printf("%s OK\n", argv[i]);
            close(fd);
            continue;
        }
        int err = errno;
        /* strerrorname_np (glibc >= 2.32) gives the symbolic name; fall back
         * to the number for codes glibc does not name. */
        const char *name = strerrorname_np(err);
        if (name != NULL)
            printf("%s %s\n", argv[i], name);
        else
            printf("%s E%d\n", argv[i], err);
    }
    fflush(stdout);
    return 0;
}
