"""The one home of REALM's block geometry: how long an evidence block and a query are, how long
their joined encoder input is, and the towers' projection size. Every config that cuts or reads
blocks takes its defaults from `GEOMETRY`; a command that opens an index checks its own block
length against the index's (`check_block_len`). No heavy imports: the CLI reads it at start-up."""

from __future__ import annotations

from dataclasses import dataclass

from ralm.configs import ConfigError


@dataclass(frozen=True)
class BlockGeometry:
    block_len: int = 288  # wordpieces per evidence block: [CLS] title [SEP] body [SEP]
    query_len: int = 64  # wordpieces per query: [CLS] x [SEP]
    dim: int = 128  # REALM's projection of the towers' vectors

    @property
    def joined_len(self) -> int:
        """The knowledge-augmented encoder's input `[CLS] x [SEP] z_body [SEP]`: a full query and
        a full block (their own [CLS] and [SEP] make room for the joined input's three)."""
        return self.query_len + self.block_len


GEOMETRY = BlockGeometry()


def check_block_len(block_len: int, index_block_len: int, index: str) -> None:
    """A config's `block_len` equals that of the blocks of the index it reads (a ConfigError
    naming the field, which the command line reports under its flag)."""
    if block_len != index_block_len:
        raise ConfigError("block_len", f"is {block_len} but index {index} holds blocks of {index_block_len} wordpieces: "
                                       f"give {index_block_len}, or rebuild the index with {block_len}")
