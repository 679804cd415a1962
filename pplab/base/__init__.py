"""Floor 1, what every floor uses: `arguments` (the checks of a user's numbers), `renames` (the
last release's names kept for one more, one table), `config` (each option of a run written once), `formatting`
(text and HTML tables, byte sizes), `machine` (how busy this machine is) and `checkpoint_files`
(a checkpoint's paths, manifest and hashes). Pure Python: no torch, so the command line reads
them before it decides to load anything."""

from pplab.base.lazy import submodules_on_first_use

__getattr__ = submodules_on_first_use(__name__)  # pplab.base.<module> after a bare `import pplab`
