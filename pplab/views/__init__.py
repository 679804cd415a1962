"""Floor 7, what people look at: `viz` (matplotlib pictures of timelines, memory, bubbles,
training), `widgets` (the live dashboard, the what-if panel, the training view, the room's table)
and `lab` (`pplab.Lab`: a lab whose pipelines show their training live, and whose record goes
to the instructor's room).
"""

from pplab.base.lazy import submodules_on_first_use

__getattr__ = submodules_on_first_use(__name__)  # pplab.views.<module> after a bare `import pplab`
