/*
 * gpuhook-runtime (and nvidia-container-runtime): the runc wrapper's start without a Python interpreter.
 *
 * An engine registers the wrapper as its runtime (docker --runtime, containerd's BinaryName, CRI-O's
 * runtime_path) and then runs it for every runtime call of every container: create, start, state,
 * kill, delete, ps, events ... Only a `create` or `run` of a container that asks for a GPU needs the
 * Python wrapper (gpuhook/cli/runtime.py), which edits the bundle's config.json and then execs runc.
 * Everything else is exec'd straight into runc (or crun) from trusted directories, with the argv and
 * environment the engine gave: runc needs that environment (NOTIFY_SOCKET, XDG_RUNTIME_DIR), and the
 * engine's environment is the engine's, not the container's.
 *
 * "Asks for a GPU" is decided as the Python wrapper's own first step decides it (request/quick.py
 * GPU_MARKERS): a config.json with none of those byte strings certainly asks for none. Any config.json
 * this cannot read in full (missing, too big, unreadable) goes to the Python wrapper, which reports it.
 * The Python wrapper is <prefix>/bin/gpuhook-runtime beside <prefix>/libexec/ where this program lives;
 * it starts without the tripwire's variables, and gets the engine's environment for runc in ENGINE_ENV
 * (tripwire.h).
 *
 * Where <prefix>/bin/gpuhook-relay is installed, a GPU create goes to it first (as argv[0]
 * "gpuhook-runtime", then our argv): it has gpuhookd edit the spec, warm, and then execs runc itself;
 * whatever gpuhookd does not do, it hands to the Python wrapper with our argv and environment.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "runtime_exec.h"
#include "tripwire.h"

#define SPEC_LIMIT (8 << 20)  /* oci.spec.SPEC_LIMIT: a bigger config.json goes to the Python wrapper */

/* request/quick.py GPU_MARKERS, in the same order. */
static const char *const markers[] = { "\\u", "NVIDIA_", "CUDA_VERSION", "nvidia-container-devices", "cdi.k8s.io" };

static char spec[SPEC_LIMIT + 1];

static _Noreturn void fail(const char *what, const char *detail)
{
    fprintf(stderr, "gpuhook-runtime: %s: %s\n", what, detail);
    exit(1);
}

/* runc's and crun's global options that take a value (`--root DIR` or `--root=DIR`). */
static int takes_value(const char *flag)
{
    static const char *const with_value[] = { "--root", "--log", "--log-format", "--log-level", "--criu",
                                              "--rootless", "--cgroup-manager" };
    for (size_t i = 0; i < sizeof with_value / sizeof *with_value; i++)
        if (strcmp(flag, with_value[i]) == 0)
            return 1;
    return 0;
}

/* The index of the command word (the first argument that is not a global option), or argc. */
static int command_index(int argc, char **argv)
{
    int i = 1;
    while (i < argc && argv[i][0] == '-') {
        if (strcmp(argv[i], "--") == 0)
            return i + 1;
        i += takes_value(argv[i]) && i + 1 < argc ? 2 : 1;
    }
    return i;
}

/* The bundle of a create/run at argv[at] (--bundle/-b DIR, --bundle=DIR, -b=DIR), "." by default. */
static const char *bundle_of(int argc, char **argv, int at)
{
    for (int i = at + 1; i < argc; i++) {
        const char *a = argv[i];
        if ((strcmp(a, "--bundle") == 0 || strcmp(a, "-b") == 0) && i + 1 < argc)
            return argv[i + 1];
        if (strncmp(a, "--bundle=", 9) == 0)
            return a + 9;
        if (strncmp(a, "-b=", 3) == 0)
            return a + 3;
    }
    return ".";
}

/* 1: <bundle>/config.json was read in full and holds none of the markers; 0: the Python wrapper decides. */
static int certainly_no_gpu(const char *bundle)
{
    char path[4096];
    int w = snprintf(path, sizeof path, "%s/config.json", bundle);
    if (w < 0 || (size_t)w >= sizeof path)
        return 0;
    /* As the Python wrapper reads it (hookcall.read_config_json): never through a symlink, never a FIFO. */
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK | O_NOFOLLOW);
    struct stat st;
    if (fd < 0)
        return 0;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        (void)close(fd);
        return 0;
    }
    size_t len = 0;
    for (;;) {
        ssize_t n = read(fd, spec + len, sizeof spec - len);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 || (n > 0 && len + (size_t)n > SPEC_LIMIT)) {
            (void)close(fd);
            return 0;
        }
        if (n == 0)
            break;
        len += (size_t)n;
    }
    (void)close(fd);
    for (size_t i = 0; i < sizeof markers / sizeof *markers; i++)
        if (memmem(spec, len, markers[i], strlen(markers[i])) != NULL)
            return 0;
    return 1;
}

/* <prefix>/bin/NAME for this program at <prefix>/libexec/...; 0 if it cannot be named. */
static int beside_bin(const char *name, char *out, size_t size)
{
    char exe[2048];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n <= 0 || (size_t)n >= sizeof exe - 1)
        return 0;
    exe[n] = '\0';
    for (int up = 0; up < 2; up++) {  /* this program's directory, then its parent, which holds bin */
        char *slash = strrchr(exe, '/');
        if (!slash || slash == exe)
            return 0;
        *slash = '\0';
    }
    int w = snprintf(out, size, "%s/bin/%s", exe, name);
    return w > 0 && (size_t)w < size;
}

/* <prefix>/bin/gpuhook-runtime for this program at <prefix>/libexec/... */
static _Noreturn void exec_python_wrapper(char **argv)
{
    char wrapper[2100];
    char **env = wrapper_environment();
    if (!beside_bin("gpuhook-runtime", wrapper, sizeof wrapper))
        fail("cannot find its own executable", "unusable /proc/self/exe");
    if (!env)
        fail(wrapper, strerror(ENOMEM));
    argv[0] = wrapper;
    execve(wrapper, argv, env);
    fail(wrapper, strerror(errno));
}

/* gpuhook-relay beside the Python wrapper, for gpuhookd to edit the spec; the wrapper if there is none. */
static _Noreturn void exec_relay(char **argv)
{
    static char mode[] = "gpuhook-runtime";  /* the relay's runtime mode: request/runtimecall.py RELAYED */
    char relay[2100];
    if (beside_bin("gpuhook-relay", relay, sizeof relay) && access(relay, X_OK) == 0) {
        char *self = argv[0];
        argv[0] = mode;
        execve(relay, argv, environ);
        argv[0] = self;  /* not runnable after all: the Python wrapper does it all */
    }
    exec_python_wrapper(argv);
}

/* Run by a front-end as the Python wrapper *as*: this program was put there (copied, linked) instead. */
static _Noreturn void not_the_wrapper(const char *as)
{
    fprintf(stderr, "gpuhook-runtime: %s is this front-end (a copy or link of it), not the Python wrapper that "
            "belongs there, and would run itself for ever: put the Python wrapper there (the launcher of "
            "gpuhook.cli.entry:runtime, as pip and the packages install it)\n", as);
    exit(1);
}

int main(int argc, char **argv)
{
    if (argc < 1)
        fail("started without argv[0]", "nothing to do");
    if (getenv(ENGINE_ENV))  /* only a front-end's start of the Python wrapper sets it */
        not_the_wrapper(argv[0]);
    int at = command_index(argc, argv);
    if (at < argc && (strcmp(argv[at], "create") == 0 || strcmp(argv[at], "run") == 0) &&
        !certainly_no_gpu(bundle_of(argc, argv, at)))
        exec_relay(argv);
    exec_runtime(argv);
}
