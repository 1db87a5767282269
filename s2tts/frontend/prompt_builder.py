"""Prompts for plain TTS and zero-shot voice cloning.

    <|im_start|>system\\n{system}<|im_end|>\\n<|im_start|>user\\n{text}<|im_end|>\\n<|im_start|>assistant\\n<|voice|>

For cloning, the system content is
    convert the provided text to speech reference to the following:\\n\\nText:\\n<|speaker:0|>{ref_text}\\n\\nSpeech:\\n
followed by one <|semantic:code0|> token per reference frame, whose input embedding also
carries all codebooks of that frame. Each text part is tokenized on its own, so BPE merges
never cross part boundaries. The `<|speaker:0|>` tag is added only when the transcript has no
speaker tag anywhere (upstream's `re.search`).

Whitespace at the ends of the text and of the transcript is stripped, where upstream keeps it for
an untagged text and a transcript (and strips every turn of a tagged one): the project cuts every
text into segments (s2tts.frontend.segment) and strips each, so a text's prompt does not depend on
whether it was cut, tagged or sent whole; and a transcript read from a file with its newline gives
the same prompt (and prefix-cache entry) as without it. Edge whitespace is never spoken.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..checkpoint_config import IM_END, IM_START, VOICE, S2Config
from ..engine.prompt import Prompt
from .segment import SPEAKER_TAG as _SPEAKER, clean_text

SYSTEM_TTS = "convert the provided text to speech"
SYSTEM_CLONE = "convert the provided text to speech reference to the following:\n\nText:\n"
CLONE_SPEECH = "\n\nSpeech:\n"


class PromptBuilder:
    def __init__(self, s2: S2Config, tokenizer_path: str | Path):
        from tokenizers import Tokenizer

        self.s2 = s2
        self.tok = Tokenizer.from_file(str(tokenizer_path))

    @classmethod
    def from_dir(cls, path: str | Path, s2: S2Config | None = None) -> "PromptBuilder":
        return cls(s2 or S2Config.from_dir(path), Path(path) / "tokenizer.json")

    def _text(self, s: str) -> list[int]:
        return self.tok.encode(s, add_special_tokens=False).ids

    def _special(self, name: str) -> list[int]:
        i = self.tok.token_to_id(name)
        if i is None:
            raise ValueError(f"tokenizer.json has no {name}")
        return [i]

    def build(self, text: str, ref_codes: torch.Tensor | None = None, ref_text: str | None = None,
              history=(), max_tokens: int | None = None) -> Prompt:
        """ref_codes: [C, frames] codes of the reference clip (from the DAC encoder).

        history: earlier segments of the same request as (user text, generated codes [frames, C]), oldest first
        (long-form speech and dialogue, `s2tts.frontend.segment`): each stays in the conversation as its user turn and an
        assistant turn `<|voice|>` + its codes + `<|im_end|>`, as upstream does, so voices and prosody carry over.
        max_tokens: the oldest history turns are left out until the prompt fits (never the system turn with the
        reference voice, never the current text); `Prompt.history_dropped` counts them."""
        s2 = self.s2
        text = clean_text(text)
        ids: list[int] = []
        sem: list[tuple[int, torch.Tensor]] = []  # (position, codes [n, C]) of semantic runs
        sem_codes = None
        sem_at = 0
        ids += self._special(IM_START) + self._text("system\n")
        if ref_codes is None:
            if ref_text:
                raise ValueError("reference_text was given without reference audio or codes")
            ids += self._text(SYSTEM_TTS)
        else:
            if not ref_text or not ref_text.strip():
                raise ValueError("a voice reference needs its transcript: give reference_text")
            ref_text = clean_text(ref_text, "reference_text")
            if not _SPEAKER.search(ref_text):
                ref_text = "<|speaker:0|>" + ref_text
            ref_codes = torch.as_tensor(ref_codes, dtype=torch.int64)
            if ref_codes.ndim != 2 or ref_codes.shape[0] != s2.num_codebooks or ref_codes.shape[1] == 0:
                raise ValueError(f"reference codes must have shape [{s2.num_codebooks}, frames>0], got {list(ref_codes.shape)}")
            if int(ref_codes.min()) < 0 or int(ref_codes[0].max()) >= s2.num_semantic or int(ref_codes.max()) >= s2.codebook_size:
                raise ValueError(f"reference codes out of range: row 0 (semantic codes) must be in [0, {s2.num_semantic}) "
                                 f"and rows 1-{s2.num_codebooks - 1} (residual codes) in [0, {s2.codebook_size}): "
                                 "send the codes dac_encoder made for the clip")
            ids += self._text(SYSTEM_CLONE) + self._text(ref_text) + self._text(CLONE_SPEECH)
            sem_at = len(ids)
            ids += (ref_codes[0] + s2.semantic_start_id).tolist()
            sem_codes = ref_codes.T
        ids += self._special(IM_END) + self._text("\n")
        prefix_len = len(ids)
        if sem_codes is not None:
            sem.append((sem_at, sem_codes))
        turns = [self._history_turn(t, c) for t, c in history]
        current = self._special(IM_START) + self._text("user\n") + self._text(text) + self._special(IM_END) + \
            self._text("\n") + self._special(IM_START) + self._text("assistant\n") + self._special(VOICE)
        dropped = 0
        if max_tokens is not None:
            while turns and prefix_len + sum(len(t[0]) for t in turns) + len(current) > max_tokens:
                turns.pop(0)
                dropped += 1
            if prefix_len + len(current) > max_tokens:
                raise ValueError(f"the prompt needs {prefix_len + len(current)} tokens (voice reference and text) but "
                                 f"{max_tokens} fit: shorten the reference or the text segment (chunk_length)")
        for turn_ids, at, turn_codes in turns:
            sem.append((len(ids) + at, turn_codes))
            ids += turn_ids
        ids += current

        tokens = torch.tensor(ids, dtype=torch.int64)
        codes = torch.zeros(len(ids), s2.num_codebooks, dtype=torch.int64)
        semantic = torch.zeros(len(ids), dtype=torch.bool)
        for at, c in sem:
            codes[at : at + c.shape[0]] = c
            semantic[at : at + c.shape[0]] = True
        return Prompt(tokens, codes, semantic, prefix_len, dropped)

    def build_segment(self, segment: str, ref_codes=None, ref_text: str | None = None, history=(),
                      room: int | None = None) -> Prompt:
        """A long text's segment k (`s2tts.frontend.segment`): its prompt with as many of the earlier segments as fit in
        `room` tokens (the sequence less the frames it may generate). Never fails for length: the first segment
        is built as a single request always was (generation then stops with `length` when the sequence is full),
        and a segment that does not fit beside any history goes without it."""
        if not history or room is None:
            return self.build(segment, ref_codes, ref_text)
        try:
            return self.build(segment, ref_codes, ref_text, history=history, max_tokens=room)
        except ValueError:
            prompt = self.build(segment, ref_codes, ref_text)
            prompt.history_dropped = len(history)
            return prompt

    def _history_turn(self, text: str, frames) -> tuple[list[int], int, torch.Tensor]:
        """An earlier segment: (its token ids, where its codes start in them, the codes [frames, C])."""
        s2 = self.s2
        frames = torch.as_tensor(frames, dtype=torch.int64)
        if frames.ndim != 2 or frames.shape[1] != s2.num_codebooks:
            raise ValueError(f"history codes must have shape [frames, {s2.num_codebooks}], got {list(frames.shape)}")
        ids = self._special(IM_START) + self._text("user\n") + self._text(clean_text(text)) + self._special(IM_END) + \
            self._text("\n") + self._special(IM_START) + self._text("assistant\n") + self._special(VOICE)
        at = len(ids)
        ids += (frames[:, 0] + s2.semantic_start_id).tolist() + self._special(IM_END) + self._text("\n")
        return ids, at, frames
