"""The shop's help centre: policy articles the chat assistant answers from, found by the database's full-text
search (SQLite FTS5, PostgreSQL's tsvector)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import String, Text, text
from sqlalchemy.orm import Mapped, Session, mapped_column

from models.base import Base, utcnow

# What the migration adds beside the table for full-text search; the models do not describe them (alembic's
# comparison leaves them out: `modelled`).
FTS_TABLE = "help_articles_fts"   # SQLite: an FTS5 index over the table, kept by triggers
SEARCH_COLUMN, SEARCH_INDEX = "search", "ix_help_articles_search"   # PostgreSQL: a generated tsvector, GIN-indexed

# Words that say nothing about which policy a question is about; a question made only of these finds no article.
STOP_WORDS = frozenset("""
a about above after again all am an and any anything are as at be been before being but by can could did do does
doing done for from get got had has have having he hello her here hey hi him his how i if in into is it its just
know let like me might mine more most much must my need no not now of off on once one only or other our out over
please really she should so some still such tell than thank thanks that the their them then there these they this
those to too up us very want was we well were what when where which while who why will with would yes yet you your
order orders shop store item items thing things help question ok okay also ask asking mail email e-mail
address number take takes taking long every each many few several mails emails don doesn didn isn wasn hasn haven
won couldn wouldn shouldn
""".split())
# At most this many words of a message go into the search (a long message is not a longer query).
MAX_QUERY_WORDS = 24
WORD = re.compile(r"[a-z0-9]+")


class HelpArticle(Base):
    """One policy article: the one-sentence `summary` carries its figures (what an answer quotes first), `body` the
    rest; `keywords` are extra words customers use for it."""

    __tablename__ = "help_articles"

    id: Mapped[int] = mapped_column(primary_key=True)
    slug: Mapped[str] = mapped_column(String(64), unique=True)
    title: Mapped[str] = mapped_column(String(200))
    summary: Mapped[str] = mapped_column(String(500))
    body: Mapped[str] = mapped_column(Text)
    keywords: Mapped[str] = mapped_column(String(500), default="")
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)

    def __repr__(self) -> str:
        return f"HelpArticle(slug={self.slug!r}, title={self.title!r})"


@dataclass(frozen=True)
class Found:
    article: HelpArticle
    score: float   # higher is better; comparable only within one database's results


def query_words(question: str) -> list[str]:
    """The words of a question worth searching for: lower-case letters and digits, no stop words, no order
    numbers' digits alone, each once."""
    words = [w for w in WORD.findall(question.lower()) if w not in STOP_WORDS and len(w) > 1 and not w.isdigit()]
    return list(dict.fromkeys(words))[:MAX_QUERY_WORDS]


def search(db: Session, question: str, limit: int = 1) -> list[Found]:
    """The articles that best match a question, best first: any of its words (stemmed), title and keywords
    weighing more than the summary. A word only an article's body holds does not find it: an answer quotes the
    summary, which would not be about the question ("gift cards" asks nothing about returns, whose body names
    them). Empty when no word matches."""
    words = query_words(question)
    if not words:
        return []
    if db.get_bind().dialect.name == "postgresql":
        # Each word is letters and digits only, so the OR-query is always valid tsquery syntax; `:AB` keeps the
        # title's, keywords' and summary's lexemes (the migration's weights; the body's are C).
        rows = db.execute(text(
            f"SELECT id, ts_rank({SEARCH_COLUMN}, q) AS score FROM help_articles, to_tsquery('english', :q) q "
            f"WHERE {SEARCH_COLUMN} @@ q ORDER BY score DESC, id LIMIT :limit"),
            {"q": " | ".join(f"{w}:AB" for w in words), "limit": limit}).all()
        ranked = [(r.id, float(r.score)) for r in rows]
    else:
        # Quoted, each word is a plain term whatever it spells (FTS5 has operators such as NOT and NEAR); the
        # column filter leaves the body out.
        rows = db.execute(text(
            f"SELECT rowid AS id, bm25({FTS_TABLE}, 10.0, 4.0, 6.0, 1.0) AS score FROM {FTS_TABLE} "
            f"WHERE {FTS_TABLE} MATCH :q ORDER BY score, rowid LIMIT :limit"),
            {"q": "{title summary keywords} : (" + " OR ".join(f'"{w}"' for w in words) + ")",
             "limit": limit}).all()
        ranked = [(r.id, -float(r.score)) for r in rows]   # bm25: lower is better
    return [Found(db.get(HelpArticle, i), score) for i, score in ranked]


def modelled(obj, name: str | None, type_: str, reflected: bool, compare_to) -> bool:
    """alembic's include_object: the full-text search objects the migration made are not in the models."""
    if type_ == "table" and name and name.startswith(FTS_TABLE):
        return False
    if type_ == "column" and name == SEARCH_COLUMN and getattr(obj, "table", None) is not None \
            and obj.table.name == HelpArticle.__tablename__:
        return False
    return not (type_ == "index" and name == SEARCH_INDEX)
