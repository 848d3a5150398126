/*
 * The tripwire's variables (hookcall.check_environment: LD_*, PYTHON* but three, glibc's loading
 * variables) and the Python runtime wrapper's environment without them.
 *
 * Static programs load nothing, so these variables act on neither gpuhook-relay nor gpuhook-runtime.c;
 * they would act on the Python wrapper's interpreter before its first line. An engine sets some of them
 * for runc as its own (containerd's opt plugin puts its library directory into every shim's
 * LD_LIBRARY_PATH: /opt/containerd/lib, or k3s's, RKE2's, any moved state's), so the wrapper is started
 * without them and gets the engine's whole environment in ENGINE_ENV, to check it and give it to runc
 * (gpuhook/cli/hygiene.py). ENGINE_ENV also says that a front-end started the wrapper: a
 * gpuhook-runtime.c that finds it was put where the wrapper belongs, and would run itself for ever.
 */
#ifndef GPUHOOK_TRIPWIRE_H
#define GPUHOOK_TRIPWIRE_H

#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define ENGINE_ENV "GPUHOOK_ENGINE_ENV"  /* hygiene.ENGINE_ENV */

extern char **environ;

/* A variable's name, up to '=', compared as bytes (Python's sorted() on str agrees for UTF-8). */
static int name_cmp(const char *a, const char *b)
{
    for (;; a++, b++) {
        unsigned char ca = *a == '=' ? 0 : (unsigned char)*a, cb = *b == '=' ? 0 : (unsigned char)*b;
        if (ca != cb || !ca)
            return ca - cb;
    }
}

/* hookcall.UNSAFE_NAMES: glibc's variables that load code or files into a process (unsecvars.h). */
static const char *const unsafe_names[] = { "GCONV_PATH", "GETCONF_DIR", "GLIBC_TUNABLES", "HOSTALIASES",
                                            "LOCALDOMAIN", "LOCPATH", "MALLOC_TRACE", "NIS_PATH", "NLSPATH",
                                            "RESOLV_HOST_CONF", "RES_OPTIONS" };

static int tripped(const char *entry)
{
    for (size_t i = 0; i < sizeof unsafe_names / sizeof *unsafe_names; i++)
        if (name_cmp(entry, unsafe_names[i]) == 0)
            return 1;
    if (strncmp(entry, "LD_", 3) != 0 && strncmp(entry, "PYTHON", 6) != 0)
        return 0;
    return name_cmp(entry, "PYTHONUNBUFFERED") && name_cmp(entry, "PYTHONDONTWRITEBYTECODE") &&
           name_cmp(entry, "PYTHONIOENCODING");
}

/*
 * Our environment without the tripped entries, and ENGINE_ENV=<hex of all of ours, each entry ended by
 * its NUL> (hex: a value holds any byte but NUL); NULL if memory runs out. All of them, not only the
 * tripped ones: the interpreter adds LC_CTYPE to its own (PEP 538), and runc gets the engine's exactly.
 */
static char **wrapper_environment(void)
{
    static const char hex[] = "0123456789abcdef";
    size_t count = 0, bytes = 0, n = 0;
    for (char **e = environ; *e; e++, count++)
        bytes += strlen(*e) + 1;
    char **env = malloc((count + 2) * sizeof *env), *stash = malloc(sizeof ENGINE_ENV + 2 * bytes + 1);
    if (!env || !stash)
        return NULL;
    char *at = stash + sizeof ENGINE_ENV;
    memcpy(stash, ENGINE_ENV "=", sizeof ENGINE_ENV);
    for (char **e = environ; *e; e++) {
        if (name_cmp(*e, ENGINE_ENV) == 0)
            continue;  /* a front-end's, never the engine's own */
        if (!tripped(*e))
            env[n++] = *e;
        for (const unsigned char *c = (const unsigned char *)*e;; c++) {  /* its NUL too */
            *at++ = hex[*c >> 4];
            *at++ = hex[*c & 15];
            if (!*c)
                break;
        }
    }
    *at = '\0';
    env[n++] = stash;
    env[n] = NULL;
    return env;
}

#endif
