#!/usr/bin/env python3
"""The main job on an embedded default (pagedweight.tools.demo): a tiny MoE model converted to AP, served by SGLang with
PagedWeight; a burst of long requests makes the experts lower their bitwidths for the KV cache, the quiet
period reloads them, and a timeline PNG shows it.

    python scripts/demo.py [--arch qwen2_moe|mixtral|qwen3_moe] [--ap-dir DIR] [--work out/demo]
"""

import sys

from pagedweight.tools.demo import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
