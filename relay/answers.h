/*
 * The hook calls gpuhook-relay answers itself, with the answer the Python hook gives them, so that most
 * containers cost no round trip to gpuhookd (~0.9 ms of its Python per call):
 *   - a poststart: nothing to do (hookcall.NOTHING);
 *   - a start (prestart, createRuntime) whose config.json holds none of GPU_MARKERS: it certainly asks for
 *     no GPU (hookcall.read_config_json's rule). gpuhookd is told, without waiting for it (a `no-gpu`
 *     notice, wire.py), so that it logs the start as one it answered and the metrics count it;
 *   - a poststop whose container certainly holds no lease (hookcall.lease_may_exist, ported).
 *
 * Every step here is a subset of the Python one: whatever it is not certain of (an argv, state, config.json,
 * config or ledger of any other shape, a file it cannot read) gives ANSWER_NONE, and the call goes to
 * gpuhookd (or the Python hook) as before. A wrong "no lease" would only delay a release (the holder watch
 * and reclaim release a lease whose container is gone), and a wrong "no GPU" would start a container without
 * the GPU it asked for; both are avoided:
 *   - the argv is gpuhook's own `[--debug] [--config F] [--daemon-socket S] STAGE` (parse_hook_argv);
 *   - the state is one JSON object strictjson.loads_object accepts (ASCII only, no escaped key, no
 *     duplicate key, at most MAX_DEPTH deep) with a plain top-level "id" ([A-Za-z0-9_.-]+) and, for a start,
 *     an absolute "bundle" (or "bundlePath") without escapes;
 *   - config.json is <bundle>/config.json, a regular file opened without following a symlink (as
 *     hookcall._open_config_json), of at most SPEC_LIMIT bytes;
 *   - the config is found and read as lease_may_exist finds and reads it (--config, GPUHOOK_CONFIG,
 *     /etc/gpuhook/config.yaml, NVIDIA's config.toml), and its state_dir taken only from the one shape
 *     _flat_state_dir accepts;
 *   - the ledger, <state_dir>/leases.json, is written whole by rename (provision/ledger_store.py), so
 *     reading it without the lock shows every lease taken before this call; no
 *     `"container_id": "<id>"` in it means no lease.
 * tests/unit/test_relay_answers.py runs the Python functions and the relay over the same inputs.
 */
#ifndef GPUHOOK_RELAY_ANSWERS_H
#define GPUHOOK_RELAY_ANSWERS_H

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#ifndef DEFAULT_CONFIG  /* these three: build.sh's RELAY_DEFINES may move them (tests) */
#define DEFAULT_CONFIG "/etc/gpuhook/config.yaml"            /* hookcall._DEFAULT_CONFIG */
#define NVIDIA_CONFIG "/etc/nvidia-container-runtime/config.toml"  /* hookcall._NVIDIA_CONFIG */
#define DEFAULT_STATE_DIR "/run/gpuhook"                     /* hookcall.DEFAULT_STATE_DIR */
#endif
#define LEDGER_NAME "leases.json"                            /* hookcall.LEDGER_NAME */
#define SPEC_LIMIT (8 << 20)                                 /* strictjson.SPEC_LIMIT; past it, gpuhookd scans */
#define CONFIG_LIMIT (1 << 20)                               /* hookcall._read_small's limit */
#define LEDGER_LIMIT (64 << 20)                              /* far above any ledger; past it, gpuhookd reads it */
#define MAX_DEPTH 64                                         /* Python's own limit is its recursion limit */
#define MAX_KEYS 4096                                        /* keys of the objects open at once */
#define MAX_NUMBER 64                                        /* int() refuses over 4300 digits */
#define MAX_ID 256                                           /* longer ids are gpuhookd's to look up and log */

/* --- the state: a conservative strict-JSON check --------------------------------------------- */

/* The top-level strings the answers need: the container's id and its bundle (either spelling). */
enum { TOP_ID, TOP_BUNDLE, TOP_BUNDLE_PATH, TOP_KEYS };
static const char *const top_names[TOP_KEYS] = { "id", "bundle", "bundlePath" };

struct top_string {
    const char *at;     /* its bytes, when it is a string without escapes (else NULL) */
    size_t len;
    int seen;
};

struct json_scan {
    const char *p, *end;
    const char *key_at[MAX_KEYS];
    size_t key_len[MAX_KEYS], keys;
    struct top_string top[TOP_KEYS];
};

static int json_value(struct json_scan *s, int depth);

static void json_blank(struct json_scan *s)
{
    while (s->p < s->end && (*s->p == ' ' || *s->p == '\t' || *s->p == '\n' || *s->p == '\r'))
        s->p++;
}

static int is_hex(char c)
{
    return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F');
}

/* A string at s->p ('"'): 0 and its raw bytes (*escaped: it holds a backslash), or -1. */
static int json_string(struct json_scan *s, const char **at, size_t *len, int *escaped)
{
    const char *p = ++s->p;
    *escaped = 0;
    for (;;) {
        if (p == s->end)
            return -1;
        unsigned char c = (unsigned char)*p;
        if (c == '"')
            break;
        if (c < 0x20 || c >= 0x80)  /* a control character (strict), or not ASCII: not worth validating UTF-8 */
            return -1;
        if (c == '\\') {
            *escaped = 1;
            if (++p == s->end)
                return -1;
            if (*p == 'u') {
                if (s->end - p < 5 || !is_hex(p[1]) || !is_hex(p[2]) || !is_hex(p[3]) || !is_hex(p[4]))
                    return -1;
                p += 4;
            } else if (!strchr("\"\\/bfnrt", *p) || !*p) {
                return -1;
            }
        }
        p++;
    }
    *at = s->p;
    *len = (size_t)(p - s->p);
    s->p = p + 1;
    return 0;
}

static const char *json_digits(const char *p, const char *end)
{
    while (p < end && *p >= '0' && *p <= '9')
        p++;
    return p;
}

/* -?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?, not too long for int() */
static int json_number(struct json_scan *s)
{
    const char *p = s->p, *d;
    if (p < s->end && *p == '-')
        p++;
    if (p < s->end && *p == '0')
        p++;
    else if ((d = json_digits(p, s->end)) > p)
        p = d;
    else
        return -1;
    if (p < s->end && *p == '.') {
        if ((d = json_digits(p + 1, s->end)) == p + 1)
            return -1;
        p = d;
    }
    if (p < s->end && (*p == 'e' || *p == 'E')) {
        p++;
        if (p < s->end && (*p == '+' || *p == '-'))
            p++;
        if ((d = json_digits(p, s->end)) == p)
            return -1;
        p = d;
    }
    if (p - s->p > MAX_NUMBER)
        return -1;
    s->p = p;
    return 0;
}

static int json_word(struct json_scan *s, const char *word)
{
    size_t n = strlen(word);
    if ((size_t)(s->end - s->p) < n || memcmp(s->p, word, n) != 0)
        return -1;
    s->p += n;
    return 0;
}

/* Past a container's opening byte: 1 if it closes at once with *close*, else 0 (at its first member). */
static int json_open(struct json_scan *s, char close)
{
    s->p++;
    json_blank(s);
    if (s->p < s->end && *s->p == close) {
        s->p++;
        return 1;
    }
    return 0;
}

/* After a member: 1 if *close* ends the container, 0 if a `,` leads to the next member, -1 otherwise. */
static int json_next(struct json_scan *s, char close)
{
    json_blank(s);
    if (s->p == s->end)
        return -1;
    if (*s->p++ == close)
        return 1;
    if (s->p[-1] != ',')
        return -1;
    json_blank(s);
    return 0;
}

/* `{ "key": value, ... }` with no key twice; at depth 1 it notes the top_names strings. */
static int json_object(struct json_scan *s, int depth)
{
    size_t first = s->keys;
    if (json_open(s, '}'))
        return 0;
    for (;;) {
        const char *key;
        size_t len;
        int escaped;
        if (s->p == s->end || *s->p != '"' || json_string(s, &key, &len, &escaped) || escaped || s->keys == MAX_KEYS)
            return -1;  /* an escaped key could equal another once decoded: not compared here */
        for (size_t k = first; k < s->keys; k++)
            if (s->key_len[k] == len && memcmp(s->key_at[k], key, len) == 0)
                return -1;
        s->key_at[s->keys] = key;
        s->key_len[s->keys++] = len;
        json_blank(s);
        if (s->p == s->end || *s->p++ != ':')
            return -1;
        json_blank(s);
        int top = TOP_KEYS;
        for (int k = 0; depth == 1 && k < TOP_KEYS; k++)
            if (strlen(top_names[k]) == len && memcmp(key, top_names[k], len) == 0)
                top = k;
        if (top < TOP_KEYS && s->p < s->end && *s->p == '"') {
            struct top_string *t = &s->top[top];
            if (json_string(s, &t->at, &t->len, &escaped))
                return -1;
            t->seen = 1;
            if (escaped)
                t->at = NULL;
        } else if (json_value(s, depth)) {
            return -1;
        } else if (top < TOP_KEYS) {
            s->top[top].seen = 1;  /* not a string: at stays NULL */
        }
        int next = json_next(s, '}');
        if (next) {
            s->keys = first;  /* its keys are done with (on an error nothing reads them again) */
            return next < 0 ? -1 : 0;
        }
    }
}

static int json_array(struct json_scan *s, int depth)
{
    if (json_open(s, ']'))
        return 0;
    for (;;) {
        int next = json_value(s, depth) ? -1 : json_next(s, ']');
        if (next)
            return next < 0 ? -1 : 0;
    }
}

/* A value inside a container at *depth* (1: the top-level object's). */
static int json_value(struct json_scan *s, int depth)
{
    const char *at;
    size_t len;
    int escaped;
    if (s->p == s->end)
        return -1;
    switch (*s->p) {
    case '{':
        return depth >= MAX_DEPTH ? -1 : json_object(s, depth + 1);
    case '[':
        return depth >= MAX_DEPTH ? -1 : json_array(s, depth + 1);
    case '"':
        return json_string(s, &at, &len, &escaped);
    case 't':
        return json_word(s, "true");
    case 'f':
        return json_word(s, "false");
    case 'n':
        return json_word(s, "null");
    default:
        return json_number(s);
    }
}

static int plain_id(const char *id, size_t len)
{
    if (!len)
        return 0;
    for (size_t i = 0; i < len; i++)
        if (!strchr("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-", id[i]) || !id[i])
            return 0;
    return 1;
}

/* 0 and the state's top-level strings when it is certainly one valid JSON object; -1 when in doubt. */
static int scan_state(const char *data, size_t len, struct top_string top[TOP_KEYS])
{
    static struct json_scan s;  /* 48 KiB of key slots: not on the stack, and written only as keys fill them */
    s.p = data;
    s.end = data + len;
    s.keys = 0;
    memset(s.top, 0, sizeof s.top);
    json_blank(&s);
    if (s.p == s.end || *s.p != '{' || json_object(&s, 1))
        return -1;
    json_blank(&s);
    if (s.p != s.end)
        return -1;
    memcpy(top, s.top, sizeof s.top);
    return 0;
}

/* --- the config and the ledger ------------------------------------------------------------------ */

enum read_result { READ_OK, READ_MISSING, READ_UNUSABLE };

/*
 * All of *path* into a malloc'ed buffer (*data, *len) if it is a regular file of at most *limit* bytes.
 * Not blocking: a FIFO there must not hang a container (it is not regular: unusable). *flags*: O_NOFOLLOW.
 */
static enum read_result read_whole(const char *path, int flags, size_t limit, char **data, size_t *len)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK | flags);
    struct stat st;
    *data = NULL;
    *len = 0;
    if (fd < 0)
        return errno == ENOENT ? READ_MISSING : READ_UNUSABLE;
    if (fstat(fd, &st) || !S_ISREG(st.st_mode) || (size_t)st.st_size > limit ||
        !(*data = malloc((size_t)st.st_size + 1))) {
        (void)close(fd);
        return READ_UNUSABLE;
    }
    size_t size = (size_t)st.st_size + 1;  /* one byte more: a file that grew is seen to */
    for (;;) {
        ssize_t n = read(fd, *data + *len, size - *len);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 || *len + (size_t)n == size) {  /* an error, or more than its size said: read it next time */
            (void)close(fd);
            free(*data);
            *data = NULL;
            return READ_UNUSABLE;
        }
        if (n == 0)
            break;
        *len += (size_t)n;
    }
    (void)close(fd);
    return READ_OK;
}

static int has_bytes(const char *text, size_t len, const char *what)
{
    return memmem(text, len, what, strlen(what)) != NULL;
}

/* hookcall._starts_plainly for the line at p (end: the text's end). */
static int starts_plainly(const char *p, const char *end, int comment_ok)
{
    if (p == end || *p == '\n' || *p == '\r' || *p == ' ' || *p == '\t' || *p == '#')
        return comment_ok;
    return *p >= 'a' && *p <= 'z';
}

/* The line after the one at p (bytes.splitlines' breaks: \n, \r\n, \r); end if none. */
static const char *next_line(const char *p, const char *end)
{
    while (p < end && *p != '\n' && *p != '\r')
        p++;
    if (p < end && *p == '\r' && p + 1 < end && p[1] == '\n')
        p++;
    return p < end ? p + 1 : end;
}

/*
 * hookcall._flat_state_dir: 0 and the state_dir (*dir, "" for null) when the config certainly sets it so
 * or leaves it at the default; -1 when its shape leaves any doubt. *dir points into text or is a constant.
 */
static int flat_state_dir(char *text, size_t len, const char **dir)
{
    char *end = text + len, *at = NULL;
    if (memchr(text, '\\', len))
        return -1;
    for (const char *line = text; line < end; line = next_line(line, end))
        if (!starts_plainly(line, end, 1))
            return -1;
    for (char *p = text; (p = memmem(p, (size_t)(end - p), "state_dir", 9)) != NULL; p += 9) {
        if (at)
            return -1;  /* twice */
        at = p;
    }
    if (!at) {
        *dir = DEFAULT_STATE_DIR;
        return 0;
    }
    /* It starts a line, as the key of a top-level `state_dir:` line, and the next line starts another key. */
    if ((at != text && at[-1] != '\n' && at[-1] != '\r') || (size_t)(end - at) < 10 || at[9] != ':' ||
        (at + 10 < end && at[10] != ' ' && at[10] != '\n' && at[10] != '\r'))
        return -1;  /* `state_dir:/x` is one scalar, not a key and its value */
    char *value = at + 10, *stop = value, *after = (char *)next_line(at, end);
    if (after < end && !starts_plainly(after, end, 0))
        return -1;
    while (stop < end && *stop != '\n' && *stop != '\r' && !(*stop == '#' && stop > value && stop[-1] == ' '))
        stop++;
    if (stop < end && *stop == '#')
        stop--;  /* partition(b" #"): the space goes with the comment */
    while (value < stop && *value == ' ')
        value++;
    while (stop > value && stop[-1] == ' ')
        stop--;
    /* hookcall._plain_path: only a plain scalar can be null; a quoted one ("", 'null') is a string */
    int quoted = stop - value > 1 && (*value == '"' || *value == '\'') && stop[-1] == *value;
    if (quoted)
        value++, stop--;
    size_t n = (size_t)(stop - value);
    if (!quoted && (n == 0 || (n == 1 && *value == '~') ||
                    (n == 4 && (!memcmp(value, "null", 4) || !memcmp(value, "Null", 4) || !memcmp(value, "NULL", 4))))) {
        /* null, where a sharing policy may limit GPUs: the full load refuses that (config.build_config) */
        if (has_bytes(text, len, "gpus") || has_bytes(text, len, "device_policy"))
            return -1;
        *dir = "";
        return 0;
    }
    if (n == 0 || *value != '/')
        return -1;
    for (const char *c = value; c < stop; c++)
        if ((unsigned char)*c < 0x20 || (unsigned char)*c >= 0x7f || strchr("\"'#:{}[],&*!|>%@`", *c))
            return -1;  /* a tag, an alias, a flow, a control or non-ASCII byte: the full load reads it */
    *stop = '\0';
    *dir = value;
    return 0;
}

/* 1: the container (*id*) certainly holds no lease under the config the hook was given (*config*: --config). */
static int no_lease(const char *config, const char *config_env, const char *id, size_t id_len)
{
    char *text = NULL, *ledger = NULL;
    size_t text_len, ledger_len;
    const char *dir;
    if (!config || !*config)
        config = config_env && *config_env ? config_env : DEFAULT_CONFIG;
    int is_default = strcmp(config, DEFAULT_CONFIG) == 0;
    enum read_result got = read_whole(config, 0, CONFIG_LIMIT, &text, &text_len);
    if (got == READ_UNUSABLE || (got == READ_MISSING && !is_default))
        return 0;  /* a named config must exist: the full load says so */
    if (is_default && text_len == 0) {  /* gpuhook has none of its own: NVIDIA's may be the config */
        free(text);
        got = read_whole(NVIDIA_CONFIG, 0, CONFIG_LIMIT, &text, &text_len);
        if (got == READ_UNUSABLE)
            return 0;
        /* Only its [gpuhook] table can move state_dir, spelled otherwise only with \u escapes. */
        if (text && !has_bytes(text, text_len, "state_dir") && !has_bytes(text, text_len, "\\u") &&
            !has_bytes(text, text_len, "\\U"))
            text_len = 0;
    }
    int certain = flat_state_dir(text ? text : (char *)"", text ? text_len : 0, &dir) == 0;
    if (certain && *dir) {
        char path[4096], needle[sizeof "\"container_id\": \"\"" + MAX_ID];
        int n = snprintf(path, sizeof path, "%s/%s", dir, LEDGER_NAME);
        certain = n > 0 && (size_t)n < sizeof path;
        if (certain) {
            got = read_whole(path, 0, LEDGER_LIMIT, &ledger, &ledger_len);
            (void)snprintf(needle, sizeof needle, "\"container_id\": \"%.*s\"", (int)id_len, id);
            certain = got == READ_MISSING || (got == READ_OK && !(ledger && has_bytes(ledger, ledger_len, needle)));
        }
    }
    free(text);
    free(ledger);
    return certain;
}

/* quick.GPU_MARKERS: a config.json without any asks for no GPU, whatever its shape. */
static const char *const gpu_markers[] = { "\\u", "NVIDIA_", "CUDA_VERSION", "nvidia-container-devices", "cdi.k8s.io" };

/* 1: the bundle's config.json certainly asks for no GPU (hookcall.read_start_config, has_gpu_marker). */
static int no_gpu(const struct top_string *bundle)
{
    char path[4096], *spec;
    size_t len;
    int certain;
    if (!bundle->at || !bundle->len || bundle->at[0] != '/')
        return 0;  /* not a string, escaped, or relative: the full path says what is wrong */
    int n = snprintf(path, sizeof path, "%.*s/config.json", (int)bundle->len, bundle->at);
    if (n <= 0 || (size_t)n >= sizeof path || read_whole(path, O_NOFOLLOW, SPEC_LIMIT, &spec, &len) != READ_OK)
        return 0;
    certain = 1;
    for (size_t m = 0; m < sizeof gpu_markers / sizeof *gpu_markers; m++)
        certain = certain && !has_bytes(spec, len, gpu_markers[m]);
    free(spec);
    return certain;
}

enum answer {
    ANSWER_NONE,        /* gpuhookd (or the Python hook) decides */
    ANSWER_NOTHING,     /* a poststart, a poststop no lease names: exit 0 */
    ANSWER_NO_GPU,      /* a start that asks for no GPU: exit 0, once gpuhookd is told (notice_no_gpu) */
};

/*
 * What the relay may answer itself for this call (argv[0] names *command*; state: the OCI state, read);
 * for ANSWER_NO_GPU the container's id in *id*, *id_len*.
 */
static enum answer own_answer(int argc, char **argv, const char *command, const char *state_data,
                              size_t state_size, size_t state_limit, const char *config_env, const char **id,
                              size_t *id_len)
{
    const char *config = NULL, *stage;
    struct top_string top[TOP_KEYS];
    int i = 1;
    if (strcmp(command, "gpuhook") != 0)
        return ANSWER_NONE;  /* NVIDIA's names: their flags are translated by the full path */
    while (argc - i > 1) {  /* hookcall.parse_hook_argv */
        const char *word = argv[i++];
        if (strcmp(word, "--debug") == 0)
            continue;
        if (strcmp(word, "--config") == 0 && argv[i][0] != '-' && argc - i > 1)
            config = argv[i++];
        else if (strncmp(word, "--config=", 9) == 0)
            config = word + 9;
        else if (strcmp(word, "--daemon-socket") == 0 && argc - i > 1)
            i++;
        else
            return ANSWER_NONE;
    }
    if (argc - i != 1)
        return ANSWER_NONE;
    stage = argv[i];
    if (strcmp(stage, "poststart") == 0)
        return ANSWER_NOTHING;  /* its state is not even decoded */
    if (state_size > state_limit || scan_state(state_data, state_size, top) || !top[TOP_ID].at ||
        top[TOP_ID].len > MAX_ID || !plain_id(top[TOP_ID].at, top[TOP_ID].len))
        return ANSWER_NONE;
    *id = top[TOP_ID].at;
    *id_len = top[TOP_ID].len;
    if (strcmp(stage, "prestart") == 0 || strcmp(stage, "createRuntime") == 0)
        return no_gpu(&top[top[TOP_BUNDLE].seen ? TOP_BUNDLE : TOP_BUNDLE_PATH]) ? ANSWER_NO_GPU : ANSWER_NONE;
    if (strcmp(stage, "poststop") == 0)
        return no_lease(config, config_env, *id, *id_len) ? ANSWER_NOTHING : ANSWER_NONE;
    return ANSWER_NONE;
}

#endif
