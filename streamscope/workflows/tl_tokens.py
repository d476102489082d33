"""TransformerLens 4.3's token helpers on a streamscope model's tokenizer: ``to_tokens``, ``to_str_tokens``,
``to_single_token`` and ``utilities.test_prompt``, with TransformerLens's BOS rule one argument away.

Re-exported by `streamscope.workflows.tl` and `streamscope.tl`, the import paths to use.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from ..engine import check_padding_side, encode, padded, prepends_bos

def tokenizer_prepends_bos(tokenizer: Any) -> bool:
    """Whether `tokenizer` puts the BOS token first by itself (TransformerLens's ``tokenizer_prepends_bos``)."""
    return prepends_bos(tokenizer)


#: Model types whose TransformerLens 4.3 adapter sets ``default_prepend_bos = False`` (the rest: True). streamscope's
#: default is the tokenizer's own rule instead; ``prepend_bos=model_type not in NO_DEFAULT_BOS`` is TL's default.
NO_DEFAULT_BOS = ("bloom", "ernie4_5", "ernie4_5_moe", "exaone", "exaone4", "glm", "glm4_moe", "glm4v", "gpt_neox",
                  "granite", "llada", "minimax_m2", "mpt", "phi", "phimoe", "qwen2", "qwen2_5_vl", "qwen3",
                  "qwen3_moe", "qwen3_vl", "recurrent_gemma", "seed_oss", "smollm3", "starcoder2")


def to_tokens(tokenizer: Any, input: str | Sequence[str], prepend_bos: Optional[bool] = None,
              padding_side: Optional[str] = None, model_type: Optional[str] = None) -> torch.Tensor:
    """``[batch, pos]`` token ids of a string or strings, as TransformerLens 4.3's ``to_tokens``.

    `prepend_bos` None (the default) is the tokenizer's own rule, what
    ``tokenizer(text)`` gives and what `model.cache`, traces, vLLM and the
    server run: the same tokens everywhere. True puts one BOS first whether or
    not the tokenizer adds it (TransformerLens's default for most families;
    ``prepend_bos=model_type not in NO_DEFAULT_BOS`` is TL 4.3's exactly);
    False leaves it out even where the tokenizer adds it. Several strings are
    padded on `padding_side`: ``"left"`` by default (position -1 is every
    prompt's last token, as in `model.cache`), or ``"right"``; the pad id is
    the tokenizer's pad token (its EOS where it has none). `model_type` is
    accepted for TransformerLens's signature and changes nothing.
    """
    texts = [input] if isinstance(input, str) else list(input)
    if not texts or not all(isinstance(text, str) for text in texts):
        raise TypeError(f"to_tokens takes a string or a list of strings, not {input!r:.80}")
    encoded = [encode(tokenizer, text, prepend_bos) for text in texts]
    tokens, _ = padded(tokenizer, encoded, check_padding_side(padding_side or "left"))
    return tokens


def to_str_tokens(tokenizer: Any, input: Any, prepend_bos: Optional[bool] = None,
                  padding_side: Optional[str] = None, model_type: Optional[str] = None) -> Any:
    """Each token of `input` (a string, a list of them, or token ids) as its string, as TL 4.3's ``to_str_tokens``."""
    if isinstance(input, list) and input and not isinstance(input[0], int):
        return [to_str_tokens(tokenizer, item, prepend_bos, padding_side, model_type) for item in input]
    if isinstance(input, str):
        ids = to_tokens(tokenizer, input, prepend_bos, padding_side, model_type)[0]
    else:
        ids = torch.as_tensor(input).squeeze()
        ids = ids.unsqueeze(0) if ids.dim() == 0 else ids
        if ids.dim() != 1:
            raise ValueError(f"to_str_tokens takes one sequence of token ids, not a tensor of shape {tuple(ids.shape)}")
    return tokenizer.batch_decode([[int(token)] for token in ids.tolist()], clean_up_tokenization_spaces=False)


def to_single_token(tokenizer: Any, string: str) -> int:
    """The one token id of `string` (no BOS), as TL 4.3's ``to_single_token``; several tokens are refused."""
    ids = to_tokens(tokenizer, string, prepend_bos=False)[0]
    if ids.numel() != 1:
        raise ValueError(f"{string!r} is {ids.numel()} tokens, not one: {ids.tolist()}")
    return int(ids[0])


def test_prompt(prompt: str, answer: str | Sequence[str], model: Any, prepend_space_to_answer: bool = True,
                print_details: bool = True, prepend_bos: Optional[bool] = None, top_k: int = 10) -> list:
    """TransformerLens 4.3's ``utilities.test_prompt`` on a streamscope model (either engine).

    Runs `prompt` followed by `answer` (several answers: their first tokens,
    compared as next-token candidates) and prints, in TL's words, the prompt's
    and answer's tokens, each answer token's rank, logit and probability, and
    the `top_k` tokens at each answer position. Returns what TL's printout
    ends with: ``[(answer token, rank)]`` per answer position (one answer),
    or per position a list over the answers (TL returns nothing). The
    prompt is tokenized by the tokenizer's own BOS rule, as `model.cache`
    does; `prepend_bos` True or False as in `to_tokens` (TL's default:
    ``prepend_bos=model_type not in NO_DEFAULT_BOS``).
    """
    tokenizer = model.tokenizer
    answers = [answer] if isinstance(answer, str) else list(answer)
    if prepend_space_to_answer:
        answers = [text if text.startswith(" ") else " " + text for text in answers]
    several = len(answers) > 1
    prompt_ids = to_tokens(tokenizer, prompt, prepend_bos, model_type=model.config.model_type)[0]
    full_answers = [to_tokens(tokenizer, text, prepend_bos=False)[0] for text in answers]
    answer_ids = [ids[:1] for ids in full_answers] if several else full_answers
    sequences = [torch.cat([prompt_ids, ids]).tolist() for ids in answer_ids]
    logits = model.cache(sequences, values=["layer_output"], layers=[model.num_layers - 1],
                         progress=False).logits.float()
    probs = logits.softmax(-1)
    prompt_length = len(prompt_ids)
    answer_strings = [to_str_tokens(tokenizer, ids) for ids in full_answers]
    if print_details:
        print("Tokenized prompt:", to_str_tokens(tokenizer, prompt_ids))
        print("Tokenized answers:" if several else "Tokenized answer:", answer_strings if several else answer_strings[0])
    ranks: list = []
    for position in range(prompt_length, prompt_length + len(answer_ids[0])):
        step = position - 1  # the logits at a position predict the next token
        order = probs[:, step].argsort(-1, descending=True)
        tokens = [int(ids[position - prompt_length]) for ids in answer_ids]
        found = [(answer_strings[row][position - prompt_length], int((order[row] == token).nonzero()[0, 0]))
                 for row, token in enumerate(tokens)]
        ranks.append(found)
        if print_details:
            print(f"Performance on answer token{'s' if several else ''}:")
            for row, token in enumerate(tokens):
                print(f"Rank: {found[row][1]: <8} Logit: {logits[row, step, token].item():5.2f} "
                      f"Prob: {probs[row, step, token].item():6.2%} Token: |{found[row][0]}|")
            for k in range(top_k):
                top = int(order[0, k])
                print(f"Top {k}th token. Logit: {logits[0, step, top].item():5.2f} "
                      f"Prob: {probs[0, step, top].item():6.2%} Token: |{tokenizer.decode([top])}|")
    result = ranks if several else [row[0] for row in ranks]
    if print_details:
        print(f"Ranks of the answer tokens: {result}")
    return result
