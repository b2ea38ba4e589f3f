#!/bin/sh
# Runs a command with address-space randomization off when the system allows it.
# ThreadSanitizer in GCC 12 aborts with "unexpected memory mapping" on kernels that use
# more mmap randomization bits than its shadow layout expects; without ASLR the layout
# is always valid. Where personality(2) is refused (some containers), runs it unchanged.
if setarch "$(uname -m)" -R true >/dev/null 2>&1; then
  exec setarch "$(uname -m)" -R "$@"
fi
exec "$@"
