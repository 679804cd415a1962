"""Floor 6, what people look at: `viz` (matplotlib pictures of timelines, memory, bubbles,
training), `widgets` (the live dashboard, the what-if panel, the training view) and
`exercises` (the course's checkers).
"""
