"""MNN's ARM kernels on any machine: an arm64 Python with MNN's aarch64 wheel, run natively on an ARM
host or under ``qemu-aarch64-static`` elsewhere.

``debian.py`` reads Debian's arm64 index and unpacks its packages (the interpreter), ``wheels.py``
fetches MNN's and numpy's aarch64 wheels, ``cache.py`` assembles both into one cached folder
(atomically, under a lock), and ``machine.py`` says where a runtime child process runs: its command
and environment (``mnn/runtime.py`` takes a ``Machine``).
"""
