"""Low-level tensor ops with no knowledge of blocks, views or models.

- `attention`: attention of queries over one key run (with its log-sum-exp), the LSE merge of partial
  results, the padded batch of single-query runs (decode).
- `gdn`: Gated DeltaNet math: short causal conv, delta rule (recurrent and chunked), affine summaries.
- `rope`: rotary position embedding at arbitrary positions.
"""
