/* nsprobe: a static "ldconfig" that reports the namespaces it was started in, then fails: the
 * host name (UTS namespace) and the network interfaces it can see (network namespace). */
#include <net/if.h>
#include <stdio.h>
#include <sys/utsname.h>

int main(void)
{
    struct utsname uts;
    struct if_nameindex *ifs, *i;

    if (uname(&uts) != 0)
        return 2;
    fprintf(stderr, "hostname=%s ifaces=", uts.nodename);
    ifs = if_nameindex();
    for (i = ifs; i != NULL && i->if_index != 0; i++)
        fprintf(stderr, "%s,", i->if_name);
    fputs(";\n", stderr);
    if (ifs != NULL)
        if_freenameindex(ifs);
    return 1;
}
