"""SQLAlchemy models shared by the web app and the worker: conversations, messages, latency records, API keys,
orders, help articles."""

from models.api_keys import ApiKey
from models.base import Base, UTCDateTime, utcnow
from models.help_articles import HelpArticle
from models.chat import ROLES, Conversation, Message, new_conversation_id
from models.orders import ORDER_STATUSES, Order
from models.records import FINISH_REASONS, SOURCES, RequestRecord
from models.summaries import DirtyMinute, JobState, KeyUsage, LatencyHistogram, SlowRequest, TrafficSummary

__all__ = [
    "FINISH_REASONS",
    "ORDER_STATUSES",
    "ROLES",
    "SOURCES",
    "ApiKey",
    "Base",
    "Conversation",
    "DirtyMinute",
    "HelpArticle",
    "JobState",
    "KeyUsage",
    "LatencyHistogram",
    "Message",
    "Order",
    "RequestRecord",
    "SlowRequest",
    "TrafficSummary",
    "UTCDateTime",
    "new_conversation_id",
    "utcnow",
]
