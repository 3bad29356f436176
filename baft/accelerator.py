"""DeepSpeed's accelerator detection, quiet where there is no GPU to detect."""

import os


def quiet_detection() -> None:
    """Without a GPU, tell DeepSpeed it runs on CPU before it is imported: its detection would
    print a warning on stdout, which a command's output (``--json``) must not carry."""
    if not os.path.exists("/dev/nvidiactl"):
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
