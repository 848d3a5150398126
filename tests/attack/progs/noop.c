/* noop.so: a shared object without side effects (an LD_PRELOAD that changes nothing). */
int gpuhook_attack_noop(void);

int gpuhook_attack_noop(void)
{
    return 0;
}
