"""Security attack suite: security.md §4's corpus, each case run through real ``runc run``.

Every case builds a hostile bundle, registers gpuhook as the prestart hook and runs it under
runc; ``rig.Rig.run`` checks the oracles around each run (o2 host files, o3 host mounts, o4
bounded time and no leftover process), and the tests assert o1 (the refusal message, or what the
started container printed) and, for started GPU containers, o5 (the container's own
``devices.list``) and the in-container half of o3 (where each gpuhook mount is).

Modules: ``test_a_paths`` (A1-A16), ``test_b_races`` (B17, B18, B21), ``test_c_devices``
(C22-C30), ``test_d_process`` (D31-D39), ``test_e_ldconfig`` (E40-E42), ``test_f_lookalikes``
(F47) and ``test_faults`` (each apply step made to fail in turn; rollback must be complete).
Helpers: ``racer.py`` (renameat2 swapper), ``pinpoint.py`` (swaps at one exact syscall, through a
seccomp user notification), ``forge.py`` (forges the state gpuhook gets), ``seccomp_wrap.py`` (one
syscall fails with EPERM), ``progs/*.c`` (built with gcc once per session).

``GPUHOOK_ATTACK_SOURCE=<dir>`` (with ``GPUHOOK_ATTACK_DROP_KEYS=cache_dir`` for settings an
older revision lacks) runs another revision of the gpuhook package through the same suite, e.g.
``git archive <rev> gpuhook | tar -x -C <dir>``, to show which attacks that revision loses.

Cases of the corpus that do not apply to a prestart hook or to this implementation:

* A3 (``..`` in configured destinations): gpuhook takes no destination from its config, the
  image or annotations; every target is built by ``planning.paths.container_path``, which refuses
  ``..`` lexically (tests/unit/test_planner.py).
* A11, A12, C28, D34, F44: not in the corpus (its numbering skips them).
* A13 (container-controlled mount source, CVE-2024-0132/CVE-2025-23359): gpuhook never mounts
  from the image. CUDA forward compatibility only lists the file names in the image's
  ``/usr/local/cuda/compat`` (resolved in the rootfs) and puts that directory first in the
  container's own ld.so configuration; every mount source is a host driver file opened with
  ``open_tree`` in the host's namespace before the container is entered.
* B19 (directory moved out of R under a held fd): from inside a container a directory can only
  be renamed within R (rename across mounts is EXDEV), and moving it outside R needs a host-side
  actor, who could write there anyway. The move within R is exercised by B17 (the lib dir renamed
  to ``.swap`` while gpuhook holds it; the mounts stay inside R).
* B20 (overmount between check and attach): needs a second privileged process mounting inside the
  container's mount namespace during the prestart hook; the container's own processes do not run
  before the hook returns, so there is no unprivileged attacker for it.
* E43 (malicious ELF): gpuhook parses no ELF file from the image (only the header of the
  configured host ldconfig); image libraries are read only by ldconfig, inside the sandbox E42
  tests.
* F45 (overmounted procfs in the hook's namespace): the hook runs in the host's namespaces; an
  overmount of the host's /proc needs host root. It matters only when the hook runs inside a
  toolkit container, which this project does not ship.
* F46 (cgroup path traversal): unit-tested on simulated ``/proc/<pid>/cgroup`` and mountinfo texts
  (tests/unit/test_cgroups.py); a real runtime never hands the hook such a path.
* B18's "absent" state and B21's ``/dev/zero`` and 10 GB variants: an absent node is simply
  created by ``mknodat`` (B18 swaps a node with a symlink instead, with a free-running racer and
  with ``pinpoint.py``, which swaps exactly between gpuhook's check and its chmod); gpuhook opens
  nothing in the image for reading (``is_debian_like`` uses ``O_PATH``), so only FIFOs that
  ldconfig reads are meaningful for B21.
"""
