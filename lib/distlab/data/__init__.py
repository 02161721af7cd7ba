"""Lab 10: the Common Crawl data pipeline, one small module per stage.

read (WET/WARC) -> language -> Gopher quality -> Gopher repetition -> toxicity -> PII
-> record-id / URL / MinHash near dedup -> line dedup -> GPT-2 token shards, with
lineage, purge and mixing (uniform or DSIR). Each stage is a
:class:`~distlab.data.document.Stage`: it takes documents, yields the ones it keeps and
records every rejection with its rule. A run's outputs are committed atomically
(:mod:`distlab.data.output`).
"""

from distlab.data.dedup import Deduper, NearDedup
from distlab.data.document import AccountingError, Document, Ledger, Stage, run_stages
from distlab.data.language import LanguageFilter, detect_language, is_english
from distlab.data.line_dedup import LineDedup, remove_repeated_lines
from distlab.data.lineage import PurgeRules, purge
from distlab.data.mix import ImportanceResampler, mix_sources
from distlab.data.output import NotARunDirectory, RunDirectory
from distlab.data.phases import PipelineConfig
from distlab.data.pii import PiiScrubber, scrub_pii
from distlab.data.pipeline import run_pipeline, shard_paths
from distlab.data.quality import GopherQualityFilter, gopher_quality_failure, passes_quality
from distlab.data.read import WarcReader, parse_wet
from distlab.data.repetition import GopherRepetitionFilter, gopher_repetition_failure
from distlab.data.report import RunReport
from distlab.data.shards import ShardWriter, tokenize_to_bin
from distlab.data.toxicity import BlocklistScorer, ClassifierScorer, PageScorer, ToxicityFilter
from distlab.data.urls import UrlDedup, normalize_url

__all__ = [
    "AccountingError", "BlocklistScorer", "ClassifierScorer", "Deduper", "Document", "GopherQualityFilter",
    "GopherRepetitionFilter", "ImportanceResampler", "LanguageFilter", "Ledger", "LineDedup", "NearDedup",
    "NotARunDirectory", "PageScorer", "PiiScrubber", "PipelineConfig", "PurgeRules", "RunDirectory", "RunReport",
    "ShardWriter",
    "Stage", "ToxicityFilter", "UrlDedup", "WarcReader", "detect_language", "gopher_quality_failure",
    "gopher_repetition_failure", "is_english", "mix_sources", "normalize_url", "parse_wet", "passes_quality", "purge",
    "remove_repeated_lines", "run_pipeline", "run_stages", "scrub_pii", "shard_paths", "tokenize_to_bin",
]
