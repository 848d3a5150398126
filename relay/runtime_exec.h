/*
 * runc, else crun, from the trusted directories only (never the engine's PATH), with the engine's
 * argv and environment: what gpuhook-runtime.c does for every call it passes through, and what
 * gpuhook-relay does once gpuhookd has edited a GPU container's spec for it.
 */
#ifndef GPUHOOK_RUNTIME_EXEC_H
#define GPUHOOK_RUNTIME_EXEC_H

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define RUNTIME_DIRS { "/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin" }

extern char **environ;

static _Noreturn void exec_runtime(char **argv)
{
    static const char *const dirs[] = RUNTIME_DIRS;
    static const char *const names[] = { "runc", "crun" };
    char path[256];
    for (size_t n = 0; n < 2; n++)
        for (size_t d = 0; d < sizeof dirs / sizeof *dirs; d++) {
            (void)snprintf(path, sizeof path, "%s/%s", dirs[d], names[n]);  /* short constants: fits */
            if (access(path, X_OK) == 0) {
                argv[0] = path;
                execve(path, argv, environ);
                fprintf(stderr, "gpuhook-runtime: %s: %s\n", path, strerror(errno));
                exit(1);
            }
        }
    fputs("gpuhook-runtime: neither runc nor crun found in /usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:"
          "/sbin:/bin\n", stderr);
    exit(1);
}

#endif
