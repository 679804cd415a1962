# EXERCISE: what one stage computes, from its parts
def stage_forward(stage, x):
    if stage.is_first:
        x = stage.embed_tokens(x)
    if stage.layers:
        cos, sin = stage.rotary_emb(x.shape[1])
        for layer in stage.layers.values():
            x = layer(x, cos, sin)
    if stage.is_last:
        x = stage.lm_head(stage.norm(x))
    return x
