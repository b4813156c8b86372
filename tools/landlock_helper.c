/* The Landlock helper of tools/landlock.py in C: the same rules, without a Python start per
 * call (about 1 ms instead of 20). Built on first use by tools.landlock.helper() with the
 * system's C compiler; where none is there, the Python helper runs instead.
 *
 * usage: landlock-helper RW_PATH... -- ARGV...
 * Allows every write right beneath RW_PATH, /tmp and /dev/shm, writing existing files under
 * /dev and /proc, and no other write; then execs ARGV. Exit 126 when the rules cannot be
 * applied: the command never runs unrestricted. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#define CREATE_RULESET 444
#define ADD_RULE 445
#define RESTRICT_SELF 446
#define VERSION_FLAG 1u
#define RULE_PATH_BENEATH 1

#define WRITE_FILE (1ull << 1)
#define REMOVE_DIR (1ull << 4)
#define REMOVE_FILE (1ull << 5)
#define MAKE_ALL (((1ull << 13) - 1) & ~((1ull << 6) - 1)) /* MAKE_CHAR .. MAKE_SYM: bits 6-12 */
#define REFER (1ull << 13)
#define TRUNCATE (1ull << 14)
#define IOCTL_DEV (1ull << 15)
#define FILE_RIGHTS (WRITE_FILE | TRUNCATE | IOCTL_DEV)

struct ruleset_attr { uint64_t handled_access_fs; };
struct path_beneath { uint64_t allowed_access; int32_t parent_fd; } __attribute__((packed));

static int fail(const char *what) {
    fprintf(stderr, "mlxterm sandbox: Landlock rules could not be applied (%s: %s); not running the command\n",
            what, strerror(errno));
    return 126;
}

static int allow(int ruleset, const char *path, uint64_t rights) {
    int fd = open(path, O_PATH | O_CLOEXEC);
    if (fd < 0) return 0; /* not in this sandbox: nothing to allow */
    struct stat st;
    if (fstat(fd, &st) == 0 && !S_ISDIR(st.st_mode)) rights &= FILE_RIGHTS;
    struct path_beneath rule = {rights, fd};
    long r = syscall(ADD_RULE, ruleset, RULE_PATH_BENEATH, &rule, 0);
    close(fd);
    return r < 0 ? -1 : 0;
}

int main(int argc, char **argv) {
    int split = 1;
    while (split < argc && strcmp(argv[split], "--") != 0) split++;
    if (split >= argc - 1) {
        fprintf(stderr, "usage: landlock-helper RW_PATH... -- ARGV...\n");
        return 2;
    }
    long abi = syscall(CREATE_RULESET, NULL, 0, VERSION_FLAG);
    if (abi < 2) {
        if (abi >= 0) errno = ENOTSUP;
        return fail("Landlock ABI 2+");
    }
    uint64_t handled = WRITE_FILE | REMOVE_DIR | REMOVE_FILE | MAKE_ALL | REFER;
    if (abi >= 3) handled |= TRUNCATE;
    if (abi >= 5) handled |= IOCTL_DEV;
    struct ruleset_attr attr = {handled};
    int ruleset = (int)syscall(CREATE_RULESET, &attr, sizeof attr, 0);
    if (ruleset < 0) return fail("landlock_create_ruleset");
    static const char *private_rw[] = {"/tmp", "/dev/shm"};
    static const char *pseudo[] = {"/dev", "/proc"};
    for (int i = 1; i < split; i++)
        if (allow(ruleset, argv[i], handled) < 0) return fail(argv[i]);
    for (int i = 0; i < 2; i++)
        if (allow(ruleset, private_rw[i], handled) < 0) return fail(private_rw[i]);
    for (int i = 0; i < 2; i++)
        if (allow(ruleset, pseudo[i], handled & FILE_RIGHTS) < 0) return fail(pseudo[i]);
    if (syscall(RESTRICT_SELF, ruleset, 0) < 0) return fail("landlock_restrict_self");
    close(ruleset);
    /* every disposition back to the default: an ignored signal stays ignored across exec, and
       the host's (SIGHUP under nohup, SIGPIPE under Python) must not reach the command */
    for (int s = 1; s < NSIG; s++)
        if (s != SIGKILL && s != SIGSTOP) signal(s, SIG_DFL);
    execv(argv[split + 1], argv + split + 1);
    return fail(argv[split + 1]);
}
