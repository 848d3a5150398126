/*
 * gpuhook-relay: the OCI hook's start without a Python interpreter.
 *
 * Runtimes start the hook, as root, for every container. Starting Python costs 10-15 ms of
 * each start, so this static program does only the hook's first steps: it checks its
 * environment, reads the OCI state from stdin and forwards its argv, environment and state,
 * with fds of its namespaces and root, to gpuhookd (a `relay` request; see
 * gpuhook/daemon/wire.py and client.py), which does all the work. The calls that certainly need none
 * (a start that asks for no GPU, a poststop no lease names: most containers' calls) it answers itself, as
 * the Python hook would (answers.h).
 *
 * Whenever the daemon cannot have started the work (no socket, a backlog that stays full, a
 * server that is not root, a failed or timed-out send, a `declined` reply), it runs the Python
 * hook it stands for instead (see find_python_hook), with the same argv and stdin and an
 * allow-listed environment (fallback_environment). Once a request is sent, anything but a reply
 * is an error, never a fallback: the work may have been half done and rolled back. Every wait has
 * a deadline (the *_TIMEOUT_* values below), so the worst case is their sum.
 *
 * Run as argv[0] "gpuhook-runtime" (by relay/gpuhook-runtime.c, for the create of a container that
 * may ask for a GPU) it relays the runtime wrapper's spec edit instead: see runtime_main.
 */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "answers.h"
#include "runtime_exec.h"
#include "tripwire.h"

#ifndef GPUHOOK_VERSION
#error "build with relay/build.sh, which sets GPUHOOK_VERSION from gpuhook/__init__.py"
#endif

#define DEFAULT_SOCKET "/run/gpuhook/gpuhookd.sock"
#define STATE_LIMIT (1 << 20)   /* strictjson.STATE_LIMIT; one byte more lets the daemon say "too big" */
#define REPLY_LIMIT (1 << 16)   /* wire.REPLY_LIMIT */
#define STDIN_TIMEOUT_MS 5000   /* hookcall.STDIN_TIMEOUT */
#define CONNECT_TIMEOUT_S 1     /* client.CONNECT_TIMEOUT: a backlog full that long is a daemon not serving */
#define SEND_TIMEOUT_S 5        /* client.SEND_TIMEOUT: server.READ_TIMEOUT, the daemon's own bound */
#define REPLY_TIMEOUT_S 150     /* client.REPLY_TIMEOUT: longer than the daemon's own request limit */
#define DEFAULT_PATH "PATH=/usr/sbin:/usr/bin:/sbin:/bin"
#define NFDS 5                  /* client.NAMESPACES and the root, in that order */
#define RUNTIME_MODE "gpuhook-runtime"  /* request/runtimecall.py RELAYED */

static char state[STATE_LIMIT + 1];
static size_t state_len;
static int state_read;          /* stdin was consumed: the fallback gets a copy */
static char out[REPLY_LIMIT + 1];  /* the request, staged; later the reply and a NUL (or a byte too many) */
static size_t out_len;
static int sock = -1, fds[NFDS], fds_sent;
static char errbuf[4096];
static sigset_t saved_mask;
static long long send_deadline;

static long long now_ms(void)
{
    struct timespec ts = { 0 };
    (void)clock_gettime(CLOCK_MONOTONIC, &ts);  /* cannot fail: a valid clock and pointer */
    return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* 1: fd is ready for *events* (or at EOF, or in error: the next call tells), 0: the deadline passed. */
static int ready(int fd, short events, long long deadline)
{
    for (;;) {
        long long left = deadline - now_ms();
        struct pollfd p = { .fd = fd, .events = events };
        if (left <= 0)
            return 0;
        int n = poll(&p, 1, (int)left);
        if (n > 0)
            return 1;
        if (n < 0 && errno != EINTR && errno != EAGAIN)
            return 1;
    }
}

static int readable(int fd, long long deadline)
{
    return ready(fd, POLLIN, deadline);
}

/*
 * LD_*, PYTHON* and glibc's other loading variables reach a root hook before its first line
 * (NVIDIAScape, CVE-2025-23266, was LD_PRELOAD reaching a root hook). This program is static and
 * loads nothing, and its fallback gets an allow-listed environment, but the environment goes on to
 * gpuhookd: finding one means the registration is unsafe, so refuse as the Python hook does
 * (hookcall.check_environment, same names, same words).
 */
static void check_environment(void)
{
    const char *prev = NULL;
    for (;;) {  /* the names sorted and unique, by selection: no allocation */
        const char *next = NULL;
        for (char **e = environ; *e; e++)
            if (tripped(*e) && (!prev || name_cmp(*e, prev) > 0) && (!next || name_cmp(*e, next) < 0))
                next = *e;
        if (!next)
            break;
        fputs(prev ? ", " : "gpuhook: the hook's environment sets ", stderr);
        fwrite(next, 1, strcspn(next, "="), stderr);
        prev = next;
    }
    if (prev) {
        fputs("; they can inject code into a root process (CVE-2025-23266). Register the hook with an "
              "explicit env such as [\"PATH=/usr/sbin:/usr/bin:/sbin:/bin\"]; for docker --gpus the hook "
              "inherits dockerd's environment: remove them from dockerd's unit (systemctl edit docker.service, "
              "/etc/default/docker) and restart it\n", stderr);
        exit(1);
    }
}

static void read_state(void)
{
    long long deadline = now_ms() + STDIN_TIMEOUT_MS;
    state_read = 1;
    while (state_len < sizeof state) {
        if (!readable(0, deadline)) {
            fputs("gpuhook: the OCI state on stdin did not arrive within 5 s (is stdin closed?)\n", stderr);
            exit(1);
        }
        ssize_t n = read(0, state + state_len, sizeof state - state_len);
        if (n == 0)
            return;
        if (n > 0)
            state_len += (size_t)n;
        else if (errno != EINTR && errno != EAGAIN) {
            fprintf(stderr, "gpuhook: cannot read the OCI state on stdin: %s\n", strerror(errno));
            exit(1);
        }
    }
}

static int write_all(int fd, const char *p, size_t n)
{
    while (n > 0) {
        ssize_t w = write(fd, p, n);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            return -1;
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

/* Its own failures read like the hook's ("gpuhook: ..." is what users find in the runtime's error). */
static _Noreturn void die(const char *what, const char *detail)
{
    fprintf(stderr, "gpuhook: gpuhook-relay %s: %s\n", what, detail);
    exit(1);
}

/*
 * The Python command this relay stands for, and where it is: the relay's own file name without a
 * "-relay" suffix, in the bin directory beside the relay's directory. bin/gpuhook-relay stands for
 * bin/gpuhook (its own directory); the package's libexec/nvidia-container-runtime-hook, a copy of
 * this program that docker --gpus finds on its PATH, for bin/nvidia-container-runtime-hook. The
 * daemon is told the name as argv[0]: it decodes NVIDIA's flags for NVIDIA's name.
 */
static char python_hook[4096];
static char self_path[2048];    /* /proc/self/exe: where this relay is, for messages */
static const char *command;

static void find_python_hook(void)
{
    char exe[2048];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n <= 0 || (size_t)n >= sizeof exe - 1)
        die("cannot find its own executable", n < 0 ? strerror(errno) : "unusable /proc/self/exe");
    exe[n] = '\0';
    memcpy(self_path, exe, (size_t)n + 1);
    char *slash = strrchr(exe, '/'), *name = slash ? slash + 1 : NULL;
    if (!name || !*name)
        die("cannot find its own executable", exe);
    *slash = '\0';
    char *up = strrchr(exe, '/');  /* exe is now the relay's directory; its parent holds bin */
    if (!up)
        die("cannot find its own executable", "it is in /");
    *up = '\0';
    size_t len = strlen(name);
    if (len > 6 && strcmp(name + len - 6, "-relay") == 0)
        name[len - 6] = '\0';
    int w = snprintf(python_hook, sizeof python_hook, "%s/bin/%s", exe, name);
    if (w < 0 || (size_t)w >= sizeof python_hook)
        die("cannot find its own executable", "path too long");
    command = strrchr(python_hook, '/') + 1;
}

/*
 * What the Python hook runs with: not our environment but an allow-list, as it runs as root and
 * its interpreter and libc act on many variables before its first line (LOCPATH with GCONV_PATH
 * loads a library into `python -I`). PATH (the default when unset or empty: an empty PATH
 * searches the cwd, the bundle), GPUHOOK_CONFIG (the hook's config search), and LANG/LC_ALL only
 * as one of the locales that need no files. gpuhookd gets the whole environment (its tripwire
 * and config search need it); only this exec is narrowed.
 */
static char *safe_env[5];

/* Our first entry NAME=..., as getenv and Python's os.environ take it; NULL if none. */
static char *entry_of(const char *name)
{
    for (char **e = environ; *e; e++)
        if (strchr(*e, '=') && name_cmp(*e, name) == 0)
            return *e;
    return NULL;
}

/* GPUHOOK_CONFIG's value, as the Python hook reads it (NULL: unset). */
static const char *config_variable(void)
{
    const char *entry = entry_of("GPUHOOK_CONFIG");
    return entry ? strchr(entry, '=') + 1 : NULL;
}

static char **fallback_environment(void)
{
    static char default_path[] = DEFAULT_PATH;
    static const char *const locales[] = { "C", "C.UTF-8", "POSIX" };
    size_t n = 0;
    char *path = entry_of("PATH"), *config = entry_of("GPUHOOK_CONFIG");
    safe_env[n++] = path && path[5] ? path : default_path;
    if (config)
        safe_env[n++] = config;
    for (int i = 0; i < 2; i++) {
        char *entry = entry_of(i ? "LC_ALL" : "LANG");
        for (size_t j = 0; entry && j < sizeof locales / sizeof *locales; j++)
            if (strcmp(strchr(entry, '=') + 1, locales[j]) == 0) {
                safe_env[n++] = entry;
                break;
            }
    }
    safe_env[n] = NULL;
    return safe_env;
}

static _Noreturn void cannot_run(const char *why)
{
    fprintf(stderr, "gpuhook: gpuhook-relay cannot run %s, the Python hook for calls gpuhookd does not serve: %s\n",
            python_hook, why);
    exit(1);
}

/* 1: the files behind fds a and b hold the same bytes (both regular, the same size). */
static int same_bytes(int a, int b)
{
    static char buf[1 << 16];
    struct stat sa, sb;
    if (fstat(a, &sa) || fstat(b, &sb) || !S_ISREG(sa.st_mode) || !S_ISREG(sb.st_mode) || sa.st_size != sb.st_size)
        return 0;
    for (off_t at = 0; at < sa.st_size;) {
        ssize_t n = pread(a, out, sizeof buf, at);  /* out[]: no request or reply is needed any more */
        if (n <= 0 || pread(b, buf, (size_t)n, at) != n || memcmp(out, buf, (size_t)n) != 0)
            return 0;
        at += n;
    }
    return 1;
}

/*
 * The fallback opened, once, and never this relay: a copy of it installed under its command's
 * name (or beside it, in bin/) would otherwise exec itself for ever when gpuhookd does not serve.
 * Refused when it is our own file (st_dev/st_ino of /proc/self/exe) or the same bytes (another
 * copy). Returns the fd, to exec (ELF) or to have checked (a script, see fallback).
 */
static int open_python_hook(void)
{
    int fd = open(python_hook, O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);  /* a FIFO must not block us */
    int self = open("/proc/self/exe", O_RDONLY | O_CLOEXEC);
    struct stat st, me;
    if (fd < 0)
        cannot_run(strerror(errno));
    if (self < 0 || fstat(self, &me) || fstat(fd, &st))
        die("cannot find its own executable", strerror(errno));
    if ((st.st_dev == me.st_dev && st.st_ino == me.st_ino) || same_bytes(fd, self)) {
        fprintf(stderr, "gpuhook: gpuhook-relay %s would fall back to %s for calls gpuhookd does not serve, "
                "which is %s; put the Python hook `%s` there, or make %s a symlink to the installed relay "
                "instead of a copy\n", self_path, python_hook,
                st.st_ino == me.st_ino && st.st_dev == me.st_dev ? "this relay itself" : "a copy of this relay",
                command, self_path);
        exit(1);
    }
    (void)close(self);
    return fd;
}

/* The Python hook, with our argv, the allow-listed environment and our stdin. */
static _Noreturn void fallback(char **argv)
{
    char magic[2] = { 0 };
    int hook = open_python_hook();
    if (sock >= 0)
        (void)close(sock);  /* CLOEXEC anyway: the hook never sees it */
    if (state_read) {  /* stdin was consumed: a copy, not CLOEXEC, becomes the hook's stdin */
        int fd = memfd_create("gpuhook-state", 0);
        if (fd < 0 || write_all(fd, state, state_len) || lseek(fd, 0, SEEK_SET) != 0 || dup2(fd, 0) != 0 ||
            close(fd) != 0)  /* fd > 2: main() made sure 0-2 are open */
            die("cannot pass the OCI state on", strerror(errno));
    }
    argv[0] = python_hook;
    (void)sigprocmask(SIG_SETMASK, &saved_mask, NULL);  /* cannot fail: valid arguments */
    /* A binary runs from the fd checked, so nothing can be swapped in between. A script (the
     * launchers are `#!python -I`) has to be reopened by path for its interpreter, as the fd is
     * CLOEXEC; a relay put there meanwhile (only root can) refuses itself the same way: no loop. */
    if (pread(hook, magic, sizeof magic, 0) == (ssize_t)sizeof magic && memcmp(magic, "#!", 2) == 0)
        execve(python_hook, argv, fallback_environment());
    else
        fexecve(hook, argv, fallback_environment());
    cannot_run(strerror(errno));
}

/* The Python runtime wrapper (python_hook in runtime mode), with the runtime's argv and the engine's
 * environment without the tripwire's variables, and all of it in ENGINE_ENV for runc (tripwire.h). */
static _Noreturn void runtime_fallback(char **argv)
{
    int wrapper = open_python_hook();  /* never this relay, nor a copy of it */
    char **env = wrapper_environment();
    (void)close(wrapper);
    if (!env)
        cannot_run(strerror(ENOMEM));
    if (sock >= 0)
        (void)close(sock);
    argv[0] = python_hook;
    (void)sigprocmask(SIG_SETMASK, &saved_mask, NULL);  /* cannot fail: valid arguments */
    execve(python_hook, argv, env);  /* a script (`#!python -I`): by path, as fallback() runs one */
    cannot_run(strerror(errno));
}

/*
 * 0: sock is connected to a root server at path; -1: not (nothing was sent, the fallback is safe).
 * A listener whose backlog is full (a daemon not accepting) blocks connect(), and a non-blocking
 * unix connect fails at once with EAGAIN rather than being pollable: SO_SNDTIMEO is the bound the
 * kernel applies to that wait (unix_stream_connect), and it ends in EAGAIN. *at_once*: a non-blocking
 * socket, which gives up on a full backlog at once.
 */
static int connect_daemon(const char *path, int at_once)
{
    struct sockaddr_un addr = { .sun_family = AF_UNIX };
    struct ucred cred;
    socklen_t len = sizeof cred;
    struct timeval connect_timeout = { .tv_sec = CONNECT_TIMEOUT_S };
    size_t n = strlen(path);
    if (n > sizeof addr.sun_path)
        return -1;
    memcpy(addr.sun_path, path, n);
    sock = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | (at_once ? SOCK_NONBLOCK : 0), 0);
    if (sock < 0 || setsockopt(sock, SOL_SOCKET, SO_SNDTIMEO, &connect_timeout, sizeof connect_timeout) ||
        connect(sock, (struct sockaddr *)&addr, (socklen_t)(offsetof(struct sockaddr_un, sun_path) + n)))
        return -1;
    /* A --daemon-socket outside /run could be anyone's: never hand our namespaces to a non-root process. */
    return getsockopt(sock, SOL_SOCKET, SO_PEERCRED, &cred, &len) || len != sizeof cred || cred.uid != 0 ? -1 : 0;
}

/*
 * Send everything by send_deadline; the first sendmsg carries our namespaces and root (SCM_RIGHTS).
 * A daemon that stops reading must not hang the container start; a partial request is never run.
 */
static int send_all(const char *p, size_t n)
{
    while (n > 0) {
        struct iovec iov = { .iov_base = (void *)p, .iov_len = n };
        struct msghdr msg = { .msg_iov = &iov, .msg_iovlen = 1 };
        union { char buf[CMSG_SPACE(sizeof fds)]; struct cmsghdr align; } ctl;
        if (!fds_sent) {
            memset(&ctl, 0, sizeof ctl);
            msg.msg_control = ctl.buf;
            msg.msg_controllen = sizeof ctl.buf;
            struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
            c->cmsg_level = SOL_SOCKET;
            c->cmsg_type = SCM_RIGHTS;
            c->cmsg_len = CMSG_LEN(sizeof fds);
            memcpy(CMSG_DATA(c), fds, sizeof fds);
        }
        ssize_t s = sendmsg(sock, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (s < 0 && errno == EINTR)
            continue;
        if (s < 0 && (errno == EAGAIN || errno == EWOULDBLOCK) && ready(sock, POLLOUT, send_deadline))
            continue;  /* the buffer is full; nothing of this call was sent (the fds neither) */
        if (s <= 0)
            return -1;
        fds_sent = 1;
        p += s;
        n -= (size_t)s;
    }
    return 0;
}

/* Stage bytes in out[], sending when it is full (and large parts directly). */
static int put(const void *p, size_t n)
{
    if (out_len + n > sizeof out) {
        if (send_all(out, out_len))
            return -1;
        out_len = 0;
    }
    if (n >= sizeof out)
        return send_all(p, n);
    memcpy(out + out_len, p, n);
    out_len += n;
    return 0;
}

/* Total length of strings joined with NUL bytes, and sending them so. */
static size_t joined_len(char **v)
{
    size_t n = 0;
    for (char **s = v; *s; s++)
        n += strlen(*s) + (s != v);
    return n;
}

static int put_joined(char **v)
{
    for (char **s = v; *s; s++)
        if ((s != v && put("", 1)) || put(*s, strlen(*s)))
            return -1;
    return 0;
}

static int send_request(char **argv)
{
    static const char *const paths[NFDS] = { "/proc/self/ns/mnt", "/proc/self/ns/cgroup", "/proc/self/ns/pid",
                                             "/proc/self/ns/user", "/" };
    char header[160];
    int ok = 1;
    for (int i = 0; i < NFDS; i++) {
        fds[i] = open(paths[i], i < 4 ? O_RDONLY | O_CLOEXEC : O_PATH | O_DIRECTORY | O_CLOEXEC);
        ok = ok && fds[i] >= 0;
    }
    argv[0] = (char *)command;  /* which command's argv this is (find_python_hook) */
    send_deadline = now_ms() + SEND_TIMEOUT_S * 1000LL;
    int n = snprintf(header, sizeof header, "gpuhookd/1 relay %zu %zu %zu %zu\n", strlen(GPUHOOK_VERSION),
                     joined_len(argv), joined_len(environ), state_len);
    ok = ok && n > 0 && (size_t)n < sizeof header && !put(header, (size_t)n) && !put(GPUHOOK_VERSION,
         strlen(GPUHOOK_VERSION)) && !put_joined(argv) && !put_joined(environ) && !put(state, state_len) &&
         !send_all(out, out_len);
    for (int i = 0; i < NFDS; i++)
        if (fds[i] >= 0)
            close(fds[i]);
    return ok ? 0 : -1;
}

/*
 * Tell gpuhookd of a no-GPU start answered here (`gpuhookd/1 no-gpu N\n` and the id; no fds, no reply), so
 * that it logs it as a start it answered and its metrics count it. Never waited for: not for a backlog
 * (at once), nor for gpuhookd to read it (it fits the socket's buffer); a daemon that cannot be told
 * misses one count, and the container starts all the same.
 */
static void notice_no_gpu(const char *path, const char *id, size_t id_len)
{
    char notice[sizeof "gpuhookd/1 no-gpu 999\n" + MAX_ID];
    int n = snprintf(notice, sizeof notice, "gpuhookd/1 no-gpu %zu\n%.*s", id_len, (int)id_len, id);
    if (n > 0 && (size_t)n < sizeof notice && connect_daemon(path, 1) == 0)
        (void)send(sock, notice, (size_t)n, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (sock >= 0)
        (void)close(sock);
}

static _Noreturn void no_answer(const char *path, const char *why)
{
    fprintf(stderr, "gpuhook: gpuhookd %s: no complete answer (%s); see gpuhookd's journal "
            "(journalctl -u gpuhookd) and the hook log\n", path, why);
    exit(1);
}

/* Digits (at least one) up to the end mark; the value saturates (a status is clamped later). */
static const char *number(const char *p, char end, unsigned long *value)
{
    const char *start = p;
    for (*value = 0; *p >= '0' && *p <= '9'; p++)
        *value = *value > 100000000 ? *value : *value * 10 + (unsigned long)(*p - '0');
    return p > start && *p == end ? p + 1 : NULL;
}

/* The whole reply, up to the daemon's close, into out[] (NUL-terminated): its length, or 0 and *why. */
static size_t read_reply(const char **why)
{
    long long deadline = now_ms() + REPLY_TIMEOUT_S * 1000LL;
    size_t len = 0;
    for (;;) {
        if (len > REPLY_LIMIT)
            return *why = "reply too long", 0;
        if (!readable(sock, deadline))
            return *why = "timed out", 0;
        ssize_t n = recv(sock, out + len, REPLY_LIMIT + 1 - len, MSG_DONTWAIT);  /* poll said: never blocks */
        if (n == 0)
            break;
        if (n > 0)
            len += (size_t)n;
        else if (errno != EINTR && errno != EAGAIN)
            return *why = strerror(errno), 0;
    }
    out[len] = '\0';  /* len <= REPLY_LIMIT: the header parses as a string (the message may hold NULs) */
    return len ? len : (*why = "connection closed", 0);
}

/* `gpuhookd/1 VERDICT STATUS N\n` and N bytes: exit as `done` says, or return on `declined`. */
static void receive_reply(const char *path)
{
    const char *why = "";
    size_t len = read_reply(&why);
    if (len == 0)
        no_answer(path, why);
    const char *p = out;
    unsigned long status, size;
    int negative = 0, declined = 0;
    if (strncmp(p, "gpuhookd/1 done ", 16) == 0)
        p += 16;
    else if (strncmp(p, "gpuhookd/1 declined ", 20) == 0)
        p += 20, declined = 1;
    else
        no_answer(path, "malformed reply");  /* pong included: we asked no ping */
    if (*p == '-')
        p++, negative = 1;
    if (!(p = number(p, ' ', &status)) || !(p = number(p, '\n', &size)) || size != len - (size_t)(p - out))
        no_answer(path, "malformed reply");
    if (declined)
        return;
    (void)write_all(2, p, size);  /* the hook's stderr, verbatim; a reader that left changes nothing */
    exit(negative ? (status ? 1 : 0) : status > 255 ? 255 : (int)status);
}

/* 1: the reply is `gpuhookd/1 done 0 N\n` and its N bytes (the edit is made); 0: anything else. */
static int edited(void)
{
    const char *why;
    size_t len = read_reply(&why);
    const char *p = out;
    unsigned long status, size;
    if (len == 0 || strncmp(p, "gpuhookd/1 done ", 16) != 0)
        return 0;
    p += 16;
    return (p = number(p, ' ', &status)) && (p = number(p, '\n', &size)) && status == 0 &&
           size == len - (size_t)(p - out);
}

/*
 * The runtime wrapper's spec edit: argv is RUNTIME_MODE and then the runtime's own arguments (runc's
 * global options, create or run, its options). gpuhookd gets a `relay` request whose argv is
 * RUNTIME_MODE, this relay's path (for the hooks it registers) and those arguments, our environment
 * (the engine's: its config search and tripwire need it) and no state (stdin is the container's, not
 * ours to read); it edits <bundle>/config.json through our root. On `done 0` we exec runc as
 * gpuhook-runtime.c would. Anything else (no daemon, declined, a failure, no answer) goes to the Python
 * wrapper, <prefix>/bin/gpuhook-runtime, with the runtime's argv and environment (less the tripwire's
 * variables; whole in ENGINE_ENV: runtime_fallback): it edits the spec itself (the edit is atomic
 * and idempotent, so one gpuhookd half did is simply done again) and reports whatever is wrong in the
 * engine's log.
 */
static _Noreturn void runtime_main(int argc, char **argv)
{
    static char *request[4096];
    const char *path = getenv("GPUHOOK_DAEMON_SOCKET");
    char *slash;
    if (!path || path[0] != '/')
        path = DEFAULT_SOCKET;
    find_python_hook();  /* self_path; python_hook names bin/gpuhook, made bin/gpuhook-runtime below */
    slash = strrchr(python_hook, '/');
    if ((size_t)(slash - python_hook) + sizeof "/" RUNTIME_MODE > sizeof python_hook)
        die("cannot find its own executable", "path too long");
    memcpy(slash + 1, RUNTIME_MODE, sizeof RUNTIME_MODE);
    command = slash + 1;
    if ((size_t)argc + 2 > sizeof request / sizeof *request)
        runtime_fallback(argv);
    request[0] = (char *)command;
    request[1] = self_path;
    for (int i = 1; i < argc; i++)
        request[i + 1] = argv[i];
    request[argc + 1] = NULL;
    if (connect_daemon(path, 0) || send_request(request) || !edited())
        runtime_fallback(argv);
    (void)close(sock);
    (void)sigprocmask(SIG_SETMASK, &saved_mask, NULL);
    exec_runtime(argv);
}

int main(int argc, char **argv)
{
    const char *path = DEFAULT_SOCKET, *slash, *id;
    size_t id_len;
    sigset_t pipe_set;
    if (argc < 1) {
        fputs("gpuhook: gpuhook-relay started without argv\n", stderr);
        return 1;
    }
    /* Full buffering: each message leaves in one write(); exit() flushes it. */
    setvbuf(stderr, errbuf, _IOFBF, sizeof errbuf);
    /* Closed std fds would be taken by our own opens, and errors could go down the socket. */
    for (int fd = 0; fd < 3; fd++)
        if (fcntl(fd, F_GETFD) < 0 && open("/dev/null", fd ? O_WRONLY : O_RDONLY) != fd)
            return 1;
    /* A reader of stderr that left must not turn our exit status into death by SIGPIPE (sends use
     * MSG_NOSIGNAL). Only paths that exit write to stderr; the fallback gets the runtime's mask back. */
    if (sigemptyset(&pipe_set) || sigaddset(&pipe_set, SIGPIPE) || sigprocmask(SIG_BLOCK, &pipe_set, &saved_mask))
        return 1;
    slash = strrchr(argv[0], '/');
    if (strcmp(slash ? slash + 1 : argv[0], RUNTIME_MODE) == 0)
        runtime_main(argc, argv);  /* the engine's environment is checked by gpuhookd, or the Python wrapper */
    check_environment();
    find_python_hook();
    for (int i = 1; i < argc; i++)
        if (strcmp(argv[i], "--daemon-socket") == 0) {
            if (i + 1 == argc)
                fallback(argv);  /* a usage error: the Python hook says so */
            path = argv[i + 1][0] ? argv[i + 1] : DEFAULT_SOCKET;  /* "": the default, as in the hook */
            break;
        }
    /* A relative path would resolve in the cwd: the bundle or the rootfs, the container's. */
    if (strcmp(path, "none") == 0 || path[0] != '/')
        fallback(argv);
    read_state();
    switch (own_answer(argc, argv, command, state, state_len, STATE_LIMIT, config_variable(), &id, &id_len)) {
    case ANSWER_NO_GPU:
        notice_no_gpu(path, id, id_len);
        return 0;
    case ANSWER_NOTHING:
        return 0;
    case ANSWER_NONE:
        break;
    }
    if (connect_daemon(path, 0) || send_request(argv))
        fallback(argv);
    receive_reply(path);
    fallback(argv);  /* declined: the daemon did nothing; the hook finds out why and logs it */
}
