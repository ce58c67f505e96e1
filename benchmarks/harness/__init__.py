"""The plumbing every benchmark shares (run a script from benchmarks/ and `import harness` works):

- server: `ember_command`, `launch`, `settled`, `stop`, `frozen`;
- memory: `PeakRss`, `tree_rss`, `tree_pids`, `peak_rss`;
- machine: `cpu_name`, `cpu_description`;
- results: `ROOT`, `RESULTS`, `write_result`;
- vectors: `row_cosines`;
- models: `QWEN_DIR`, `ensure_qwen3_model`, `checkpoints` (the tests' builders), `use_server_allocator`;
- roofline (`compute_limit`) and reference (`reference_tokens_per_s`), imported from their modules (they load torch).
"""

from harness.machine import cpu_description, cpu_name
from harness.memory import PeakRss, peak_rss, tree_pids, tree_rss
from harness.models import QWEN_DIR, checkpoints, ensure_qwen3_model, use_server_allocator
from harness.results import RESULTS, ROOT, write_result
from harness.server import ember_command, frozen, launch, settled, stop
from harness.vectors import row_cosines

__all__ = [
    "QWEN_DIR",
    "RESULTS",
    "ROOT",
    "PeakRss",
    "checkpoints",
    "cpu_description",
    "cpu_name",
    "ember_command",
    "ensure_qwen3_model",
    "frozen",
    "launch",
    "peak_rss",
    "row_cosines",
    "settled",
    "stop",
    "tree_pids",
    "tree_rss",
    "use_server_allocator",
    "write_result",
]
