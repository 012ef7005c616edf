"""Every environment variable kvserve reads, in one place: its name, default and what it does.

Values are read when asked for, not at import, so that tests and child processes can set them.
Configuration belongs in the dataclasses of kvserve/config.py (one flag per field); these are the
few switches that must work before any configuration exists (where to cache, whether to compile)
or that a kernel reads at launch, plus the server's keys kept out of the command line.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class EnvVar:
    name: str
    default: str
    help: str

    def get(self) -> str:
        """The value, or the default when unset or empty."""
        return os.environ.get(self.name) or self.default

    def is_on(self) -> bool:
        """For switches: anything but "" and "0" is on."""
        return self.get() not in ("", "0")

    def set(self, value: str) -> None:
        """Sets it in this process's environment, which processes started from now on inherit."""
        os.environ[self.name] = value


KVSERVE_CACHE_DIR = EnvVar("KVSERVE_CACHE_DIR", "~/.cache/kvserve",
                           "where converted GGUF tokenizers and compiled CPU kernels are kept")
KVSERVE_DISABLE_CPU_KERNELS = EnvVar("KVSERVE_DISABLE_CPU_KERNELS", "0",
                                     "1: never build or use the C CPU kernels (the torch path runs)")
KVSERVE_HUGE_PAGES = EnvVar("KVSERVE_HUGE_PAGES", "1", "0: do not back packed CPU weights with transparent huge pages")
KVSERVE_PDL = EnvVar("KVSERVE_PDL", "1", "0: launch the Triton kernels without programmatic dependent launch")
KVSERVE_BLOCK_COPY_KERNEL = EnvVar("KVSERVE_BLOCK_COPY_KERNEL", "1",
                                   "0: move KV blocks to and from the host tier with torch copies, not the Triton "
                                   "block-copy kernel")
KVSERVE_LOAD_COPY_ENGINE = EnvVar("KVSERVE_LOAD_COPY_ENGINE", "alone",
                                  "which loads from long runs of host rows go by the copy engine rather than the "
                                  "block-copy kernel: alone (those in a step without a batch), always, never")
KVSERVE_API_KEY = EnvVar("KVSERVE_API_KEY", "", "the server's API key when --api-key is not given")
KVSERVE_ADMIN_API_KEY = EnvVar("KVSERVE_ADMIN_API_KEY", "",
                               "the server's admin key (GET /v1/usage) when --admin-api-key is not given")
CC = EnvVar("CC", "", "the C compiler for the CPU kernels (default: cc, then gcc)")
TRITON_INTERPRET = EnvVar("TRITON_INTERPRET", "0", "Triton's own: 1 runs kernels in its CPU interpreter (tests)")
PROMETHEUS_MULTIPROC_DIR = EnvVar("PROMETHEUS_MULTIPROC_DIR", "",
                                  "prometheus_client's own; `kvserve serve --api-server-count N` sets it for its "
                                  "front ends (their request metrics are summed there)")

ALL = (KVSERVE_CACHE_DIR, KVSERVE_DISABLE_CPU_KERNELS, KVSERVE_HUGE_PAGES, KVSERVE_PDL, KVSERVE_BLOCK_COPY_KERNEL,
       KVSERVE_LOAD_COPY_ENGINE, KVSERVE_API_KEY, KVSERVE_ADMIN_API_KEY, CC, TRITON_INTERPRET, PROMETHEUS_MULTIPROC_DIR)


def cache_dir() -> str:
    """The absolute cache directory."""
    return os.path.abspath(os.path.expanduser(KVSERVE_CACHE_DIR.get()))
