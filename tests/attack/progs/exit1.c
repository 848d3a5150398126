/* exit1: a static "ldconfig" that always fails, to make gpuhook's ldconfig step fail. */
#include <stdio.h>

int main(void)
{
    fputs("boom\n", stderr);
    return 1;
}
