"""Code instructions written for draft training (`--data code`): Python modules and single functions.

Written here from scratch; none is taken from an evaluation set. The subjects of the bench's three seed
prompts (task store, key-value report, doubly linked list) and functions close to HumanEval problems
(palindromes, gcd, factorisation, vowels, medians, Roman numerals, bracket matching, ...) are left out.
"""
from __future__ import annotations

import random

# (subject, main class or dataclass names, operations)
MODULES = [
    ("inventory manager", "an Item dataclass, a Category enum, an Inventory class",
     ["add_item", "remove_item", "restock", "find_by_sku", "low_stock", "total_value", "to_csv", "from_csv"]),
    ("bank account", "an Account dataclass, a TransactionType enum, a Bank class",
     ["open_account", "deposit", "withdraw", "transfer", "statement", "apply_interest", "close_account"]),
    ("library catalog", "a Book dataclass, a Genre enum, a Library class",
     ["add_book", "remove_book", "checkout", "return_book", "search_by_author", "overdue_books", "to_json"]),
    ("LRU cache", "an LRUCache class with a fixed capacity",
     ["get", "put", "delete", "resize", "keys_in_order", "hit_rate", "clear"]),
    ("min-heap priority queue", "a PriorityQueue class backed by a list",
     ["push", "pop", "peek", "update_priority", "merge", "heapify", "is_empty"]),
    ("binary search tree", "a TreeNode dataclass and a BinarySearchTree class",
     ["insert", "delete", "contains", "min_value", "max_value", "inorder", "height", "is_balanced"]),
    ("directed graph", "a Graph class with adjacency lists",
     ["add_edge", "remove_edge", "bfs", "dfs", "has_cycle", "topological_sort", "shortest_path"]),
    ("event scheduler", "an Event dataclass, a Recurrence enum, a Scheduler class",
     ["schedule", "cancel", "events_on", "next_event", "conflicts", "reschedule", "export_ical"]),
    ("text statistics", "a TextStats class",
     ["word_count", "sentence_count", "top_words", "average_word_length", "readability", "summary"]),
    ("rate limiter", "a TokenBucket class and a SlidingWindowLimiter class",
     ["allow", "remaining", "reset", "wait_time", "refill", "stats"]),
    ("contact book", "a Contact dataclass and a ContactBook class",
     ["add_contact", "update_contact", "delete_contact", "search", "group_by_city", "to_vcard", "import_csv"]),
    ("expense tracker", "an Expense dataclass, a Category enum, an ExpenseTracker class",
     ["add_expense", "delete_expense", "monthly_total", "by_category", "budget_alerts", "to_json", "from_json"]),
    ("student gradebook", "a Student dataclass and a Gradebook class",
     ["add_student", "record_grade", "average", "letter_grade", "top_students", "failing_students", "report"]),
    ("shopping cart", "a Product dataclass, a CartItem dataclass, a ShoppingCart class",
     ["add_product", "remove_product", "update_quantity", "subtotal", "apply_coupon", "tax", "checkout"]),
    ("parking lot", "a Vehicle dataclass, a SpotSize enum, a ParkingLot class",
     ["park", "leave", "available_spots", "find_vehicle", "fee", "occupancy_report"]),
    ("matrix utilities", "a Matrix class",
     ["add", "multiply", "transpose", "determinant", "inverse", "identity", "trace", "__eq__"]),
    ("fraction arithmetic", "a Fraction class",
     ["__add__", "__sub__", "__mul__", "__truediv__", "simplify", "to_float", "from_string", "__lt__"]),
    ("polynomial", "a Polynomial class",
     ["__add__", "__mul__", "evaluate", "derivative", "integral", "degree", "__str__"]),
    ("trie autocomplete", "a TrieNode class and a Trie class",
     ["insert", "search", "starts_with", "autocomplete", "delete", "count_words", "longest_common_prefix"]),
    ("union-find", "a DisjointSet class with path compression and union by rank",
     ["make_set", "find", "union", "connected", "component_count", "components"]),
    ("circular buffer", "a RingBuffer class",
     ["append", "pop_left", "peek", "is_full", "to_list", "extend", "clear"]),
    ("sparse vector", "a SparseVector class",
     ["dot", "add", "scale", "norm", "nonzero_count", "to_dense", "from_dense"]),
    ("2D vector geometry", "a Vector2D dataclass and a Polygon class",
     ["length", "normalize", "dot", "rotate", "area", "perimeter", "contains_point"]),
    ("bloom filter", "a BloomFilter class",
     ["add", "might_contain", "false_positive_rate", "union", "size_for", "clear"]),
    ("hash map with separate chaining", "a HashMap class",
     ["put", "get", "remove", "resize", "keys", "values", "load_factor"]),
    ("log file analyzer", "a LogEntry dataclass, a Level enum, a LogAnalyzer class",
     ["parse_line", "load", "count_by_level", "errors_between", "top_messages", "export_summary"]),
    ("URL shortener", "a ShortUrl dataclass and a UrlShortener class",
     ["shorten", "expand", "delete", "click", "top_links", "expired", "to_json"]),
    ("recipe scaler", "an Ingredient dataclass and a Recipe class",
     ["add_ingredient", "scale", "convert_units", "shopping_list", "total_calories", "to_markdown"]),
    ("movie ratings", "a Movie dataclass and a RatingStore class",
     ["add_movie", "rate", "average_rating", "top_rated", "by_genre", "recommend", "export_csv"]),
    ("employee directory", "an Employee dataclass, a Department enum, a Directory class",
     ["hire", "fire", "promote", "find_by_manager", "payroll", "org_chart", "to_json"]),
    ("tic-tac-toe game", "a Board class and a Game class",
     ["make_move", "winner", "is_draw", "available_moves", "best_move", "render", "reset"]),
    ("sudoku checker", "a Sudoku class",
     ["from_string", "is_valid", "candidates", "solve", "is_solved", "render"]),
    ("interval set", "an Interval dataclass and an IntervalSet class",
     ["add", "remove", "merge_all", "contains", "total_length", "gaps", "intersection"]),
    ("file deduplicator", "a FileRecord dataclass and a Deduplicator class",
     ["scan", "hash_file", "duplicates", "wasted_bytes", "report", "delete_duplicates"]),
    ("CSV report generator", "a Column dataclass and a Report class",
     ["load_csv", "filter_rows", "group_by", "aggregate", "sort_by", "to_markdown", "save_csv"]),
    ("unit converter", "a Unit enum and a Converter class",
     ["convert", "register_unit", "supported_units", "parse_quantity", "format_quantity"]),
    ("password policy checker", "a Policy dataclass and a PasswordChecker class",
     ["check", "strength", "suggestions", "generate_password", "is_common", "entropy"]),
    ("hotel reservation system", "a Room dataclass, a RoomType enum, a Hotel class",
     ["book", "cancel", "available_rooms", "occupancy", "invoice", "guests_on"]),
    ("stack-based calculator", "a Tokenizer class and a Calculator class",
     ["tokenize", "to_postfix", "evaluate", "add_function", "variables", "history"]),
    ("run-length encoder", "an Encoder protocol and an RLEEncoder class",
     ["encode", "decode", "roundtrip", "compression_ratio", "encode_file", "decode_file"]),
    ("weather station", "a Reading dataclass and a WeatherStation class",
     ["record", "daily_average", "max_temperature", "rainy_days", "trend", "export_json"]),
    ("voting system", "a Ballot dataclass and an Election class",
     ["cast", "plurality_winner", "runoff_winner", "tally", "turnout", "results_table"]),
    ("playlist manager", "a Song dataclass and a Playlist class",
     ["add_song", "remove_song", "shuffle", "total_duration", "by_artist", "move", "export_m3u"]),
    ("order book", "an Order dataclass, a Side enum, an OrderBook class",
     ["place", "cancel", "best_bid", "best_ask", "match", "depth", "spread"]),
    ("course enrollment", "a Course dataclass, a Student dataclass, an Enrollment class",
     ["enroll", "drop", "waitlist", "roster", "prerequisites_met", "schedule_conflicts"]),
    ("dependency resolver", "a Package dataclass and a Resolver class",
     ["add_package", "dependencies", "install_order", "detect_cycles", "reverse_dependencies"]),
    ("markdown table formatter", "a Table class",
     ["add_row", "align", "to_markdown", "from_markdown", "sort_by", "column_widths"]),
    ("time tracker", "a TimeEntry dataclass and a TimeTracker class",
     ["start", "stop", "total_for_project", "weekly_report", "overlapping", "export_csv"]),
    ("elevator simulator", "a Request dataclass, a Direction enum, an Elevator class",
     ["request", "step", "current_floor", "pending", "run_until_idle", "log"]),
    ("chess move validator", "a Piece enum, a Position dataclass, a Board class",
     ["place", "legal_moves", "is_check", "move", "from_fen", "render"]),
]

MODULE_ENDINGS = [
    "Return only one complete Python file.",
    "Use type hints and docstrings. Return only one complete Python file.",
    "Use only the standard library. Return only one complete Python file.",
    "Explain the design briefly, then give the complete Python file.",
]

FUNCTIONS = [
    ("flatten(nested: list) -> list", "flattens an arbitrarily nested list"),
    ("chunk(items: list, size: int) -> list[list]", "splits a list into chunks of the given size"),
    ("rotate_matrix(m: list[list[int]]) -> list[list[int]]", "rotates a square matrix 90 degrees clockwise"),
    ("merge_sorted(a: list[int], b: list[int]) -> list[int]", "merges two sorted lists into one sorted list"),
    ("word_frequencies(text: str) -> dict[str, int]", "counts how often each word occurs, case-insensitively"),
    ("is_anagram(a: str, b: str) -> bool", "checks whether two strings are anagrams of each other"),
    ("longest_increasing_subsequence(nums: list[int]) -> int", "returns the length of the longest strictly increasing subsequence"),
    ("binary_search(items: list[int], target: int) -> int", "returns the index of target in a sorted list, or -1"),
    ("transpose(rows: list[list]) -> list[list]", "transposes a rectangular list of lists"),
    ("matrix_multiply(a: list[list[float]], b: list[list[float]]) -> list[list[float]]", "multiplies two matrices"),
    ("parse_duration(text: str) -> int", "parses strings like '1h30m15s' into seconds"),
    ("camel_to_snake(name: str) -> str", "converts CamelCase identifiers to snake_case"),
    ("snake_to_camel(name: str) -> str", "converts snake_case identifiers to CamelCase"),
    ("pascal_triangle(n: int) -> list[list[int]]", "returns the first n rows of Pascal's triangle"),
    ("group_anagrams(words: list[str]) -> list[list[str]]", "groups words that are anagrams of each other"),
    ("compress(s: str) -> str", "run-length encodes a string like 'aaabcc' as 'a3b1c2'"),
    ("valid_ipv4(address: str) -> bool", "checks whether a string is a valid dotted IPv4 address"),
    ("days_between(a: str, b: str) -> int", "returns the number of days between two ISO dates"),
    ("spiral_order(m: list[list[int]]) -> list[int]", "returns the elements of a matrix in spiral order"),
    ("kth_smallest(nums: list[int], k: int) -> int", "returns the k-th smallest element"),
    ("count_islands(grid: list[list[str]]) -> int", "counts groups of connected '1' cells in a grid"),
    ("edit_distance(a: str, b: str) -> int", "returns the Levenshtein distance between two strings"),
    ("interleave(a: list, b: list) -> list", "interleaves two lists, appending the rest of the longer one"),
    ("nearest_point(points: list[tuple[float, float]], p: tuple[float, float]) -> tuple[float, float]", "returns the point closest to p"),
    ("anagram_index(text: str, word: str) -> list[int]", "returns start indices of anagrams of word in text"),
    ("unique_paths(rows: int, cols: int) -> int", "counts paths from the top-left to the bottom-right moving right or down"),
    ("coin_change(coins: list[int], amount: int) -> int", "returns the fewest coins that make up the amount, or -1"),
    ("top_k_frequent(nums: list[int], k: int) -> list[int]", "returns the k most frequent elements"),
    ("slugify(title: str) -> str", "turns a title into a lowercase URL slug with hyphens"),
    ("format_bytes(n: int) -> str", "formats a byte count as a human-readable string like '1.5 MB'"),
    ("parse_query_string(qs: str) -> dict[str, list[str]]", "parses a URL query string into a dict of value lists"),
    ("flatten_dict(d: dict, sep: str = '.') -> dict", "flattens nested dictionaries into dotted keys"),
    ("deep_merge(a: dict, b: dict) -> dict", "recursively merges two dictionaries, b winning on conflicts"),
    ("word_wrap(text: str, width: int) -> list[str]", "wraps text into lines of at most width characters"),
    ("parse_csv_line(line: str) -> list[str]", "splits one CSV line, honouring double-quoted fields"),
    ("rotate_list(items: list, k: int) -> list", "rotates a list to the right by k places"),
    ("merge_intervals(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]", "merges overlapping intervals"),
    ("heap_sort(items: list[int]) -> list[int]", "sorts a list with heap sort, without the heapq module"),
    ("dijkstra(graph: dict[str, dict[str, int]], source: str) -> dict[str, int]", "returns shortest distances from source"),
    ("topological_order(deps: dict[str, list[str]]) -> list[str]", "orders tasks so that dependencies come first"),
    ("is_valid_email(address: str) -> bool", "checks an e-mail address against a simple pattern"),
    ("batched(items: list, n: int) -> list[tuple]", "groups items into tuples of n, the last one possibly shorter"),
    ("moving_sum(values: list[int], window: int) -> list[int]", "returns the sums of every full window"),
    ("matrix_determinant(m: list[list[float]]) -> float", "computes a determinant by Gaussian elimination"),
    ("longest_common_prefix(words: list[str]) -> str", "returns the longest prefix all words share"),
    ("run_length_decode(s: str) -> str", "expands strings like 'a3b1c2' into 'aaabcc'"),
]

FUNCTION_STYLES = [
    "Write a Python function `{sig}` that {desc}. Include a docstring with examples.",
    "Implement `{sig}` in Python: it {desc}. Add a few assert-based tests.",
    "Complete the following Python function.\n```python\ndef {sig}:\n    \"\"\"{Desc}.\"\"\"\n```",
]


def code_instructions(seed: int = 0) -> list[str]:
    """About 400 distinct code prompts."""
    rng = random.Random(seed)
    out = []
    for subject, classes, ops in MODULES:
        for ending in MODULE_ENDINGS:
            chosen = rng.sample(ops, k=min(len(ops), rng.randint(4, 7)))
            tests = rng.choice([3, 4, 5, 6])
            out.append(f"Write a complete Python {subject} module. Include {classes}, "
                       f"{', '.join(chosen)}, and {tests} tests. {ending}")
    for sig, desc in FUNCTIONS:
        for style in FUNCTION_STYLES:
            out.append(style.format(sig=sig, desc=desc, Desc=desc[0].upper() + desc[1:]))
    return out
