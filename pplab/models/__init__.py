"""Floor 1, the models a pipeline cuts: `llama` (pplab's small LLaMA-style decoder, public as
`pplab.models.llama`), `hf` (Hugging Face causal language models described in the same terms),
`traced` (any module, cut at names by torch's tracer) and `partition` (cutting a model into
stages, on the meta device first)."""

from pplab.base.lazy import submodules_on_first_use

__getattr__ = submodules_on_first_use(__name__)  # pplab.models.<module> after a bare `import pplab`
