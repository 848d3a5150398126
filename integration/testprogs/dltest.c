/* dltest: dlopen() each argv name the way a CUDA application would.
 *
 * Usage: dltest [-p] NAME...
 * Prints "dlopen NAME: OK" (with -p: "dlopen NAME: OK PATH", PATH being the
 * file the dynamic loader actually mapped) or "dlopen NAME: FAIL <dlerror()>".
 * Exits 1 if any name failed, 2 on usage errors, 0 otherwise.
 *
 * It is linked dynamically against the glibc copied into the test rootfs so
 * that dlopen() resolves names exactly as a real container does: through the
 * container's /etc/ld.so.cache and the loader's default directories.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <link.h>
#include <stdio.h>
#include <string.h>

int main(int argc, char **argv)
{
    int first = 1;
    int show_path = 0;
    int failed = 0;

    if (argc > 1 && strcmp(argv[1], "-p") == 0) {
        show_path = 1;
        first = 2;
    }
    if (first >= argc) {
        fprintf(stderr, "usage: dltest [-p] NAME...\n");
        return 2;
    }
    for (int i = first; i < argc; i++) {
        void *handle = dlopen(argv[i], RTLD_NOW);
        if (handle == NULL) {
            const char *err = dlerror();
            printf("dlopen %s: FAIL %s\n", argv[i], err ? err : "(no dlerror)");
            failed = 1;
            continue;
        }
        struct link_map *map = NULL;
        if (show_path && dlinfo(handle, RTLD_DI_LINKMAP, &map) == 0 && map != NULL)
            printf("dlopen %s: OK %s\n", argv[i], map->l_name);
        else
            printf("dlopen %s: OK\n", argv[i]);
    }
    fflush(stdout);
    return failed;
}
