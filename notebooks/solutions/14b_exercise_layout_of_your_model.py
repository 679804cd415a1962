# EXERCISE: where the Phi model keeps its parts
my_layout = pplab.models.hf.Layout(
    embed="model.embed_tokens",
    blocks="model.layers",
    norm="model.final_layernorm",    # not "model.norm": Phi names its final norm differently
    head="lm_head",
    rotary="model.rotary_emb",       # no weights, but every stage with blocks needs it
    dropout="model.embed_dropout",   # no weights either: after the embeddings, on the first stage
)
