# EXERCISE: documents -> (inputs, targets) rows of seq_len tokens
def pack_documents(token_lists, seq_len, bos, eos):
    stream = [token for ids in token_lists for token in (bos, *ids, eos)]
    rows = (len(stream) - 1) // seq_len  # each window needs seq_len + 1 tokens; the tail is dropped
    windows = [stream[i * seq_len:i * seq_len + seq_len + 1] for i in range(rows)]  # sharing one token
    return [w[:-1] for w in windows], [w[1:] for w in windows]
