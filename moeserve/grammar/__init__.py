"""Structured output: a request's ``GuidedDecodingParams`` compiled to a grammar, and the
token masks that hold its samples to it (llguidance).

    compile.py     params -> llguidance grammar; a bad schema, regex or grammar is a
                   GrammarError naming the field (the API answers 400 with it)
    tokenizer.py   the model's tokenizer as llguidance sees it (one per vocabulary)
    bitmask.py     a packed token bitmask applied to logits (the C kernel of
                   ``ops/cpu/bitmask.c`` for fp32, else plain torch)
    bank.py        the sampling rank's matchers, one per constrained sequence: masks for a
                   step's rows, and for each draft position under speculative decoding

Why llguidance and not xgrammar: both compile JSON schemas, regexes and grammars into CPU
token masks, but xgrammar's wheel requires ``triton`` on Linux x86 (a 285 MB GPU compiler
a CPU engine never runs), while llguidance is one 3 MB wheel without dependencies. It also
takes Lark grammars and converts GBNF, rolls back for speculative decoding and computes
masks for a batch in parallel (vLLM and SGLang ship it as a backend too).
"""
