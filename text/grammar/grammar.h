/* grammar.h: constrained decoding. A context-free grammar over bytes, written in GBNF (the
 * form llama.cpp's server takes), compiled once and shared by every request that names it;
 * regular expressions, choices and JSON schemas are translated to GBNF text first, so GBNF
 * is the one form the engine compiles. A matcher follows one sequence through the grammar
 * (a set of parse stacks, advanced a byte at a time: tokens may end inside a UTF-8
 * character) and gives, for each step, the mask of the vocabulary's tokens that keep the
 * output in the grammar.
 *
 * The GBNF dialect (llama.cpp's grammars/README.md):
 *   root ::= "{" ws pair ("," ws pair)* "}"      a rule: name ::= alternatives
 *   "lit\n\"\\\x41\u00e9\U0001F600"             literals (escapes \n \r \t \\ \" \' \[ \] \- \xHH \uHHHH \UHHHHHHHH)
 *   [a-z0-9_] [^"\\\x00-\x1f] .                  character classes over code points; . is any character
 *   ( ... | ... )  x*  x+  x?  x{m}  x{m,}  x{m,n}   grouping, alternatives, repetition
 *   # comment to the end of the line; rule names [A-Za-z0-9_-]+; newlines end a rule unless
 *   inside parentheses or after | (as llama.cpp parses them)
 * The start rule is "root". Left recursion (a rule that can reach itself before consuming a
 * byte) is refused: the matcher is a pushdown automaton, not a general parser. */
#ifndef CS_GRAMMAR_H
#define CS_GRAMMAR_H

#include <jansson.h>
#include <stddef.h>
#include <stdint.h>

#include "base/common.h"
#include "text/tokenizer.h"

typedef struct grammar grammar_t;

/* Compile GBNF text (start rule "root"). CS_EINVAL with a message naming the line, column and
 * what is wrong (an undefined rule, left recursion, a bad escape, ...). */
int grammar_compile(const char *gbnf, size_t len, grammar_t **out);
grammar_t *grammar_ref(grammar_t *g);     /* another holder (atomic count) */
void grammar_unref(grammar_t *g);         /* the last one frees it; NULL is fine */
int grammar_n_rules(const grammar_t *g);

/* ---- translations to GBNF (each returns malloc'd NUL-terminated text in *gbnf) ---- */
/* A regular expression (Python re syntax, as vLLM's guided_regex and JSON Schema's pattern
 * take it) matched in full: root matches exactly the strings re.fullmatch accepts. CS_EINVAL
 * naming the construct it does not support (backreferences, lookaround, ...). */
int grammar_regex_to_gbnf(const char *re, size_t len, char **gbnf);
/* The same for the inside of a JSON string (JSON Schema's pattern): what the expression matches
 * is the string's value, its text in the grammar escaped as JSON writes it (" \ and control
 * characters as \" \\ \n \uXXXX ...). */
int grammar_json_pattern_to_gbnf(const char *re, size_t len, char **gbnf);
/* One of n literal strings (vLLM's guided_choice). */
int grammar_choice_to_gbnf(const char *const *choices, int n, char **gbnf);
/* A Lark grammar (the form vLLM's guided_grammar takes besides GBNF; start rule "start";
 * text/grammar/lark.c says what of Lark is taken). CS_EINVAL naming the construct and line. */
int grammar_lark_to_gbnf(const char *src, size_t len, char **gbnf);
/* true when src has no "::=": Lark rather than GBNF */
bool grammar_is_lark(const char *src, size_t len);

/* JSON Schema -> GBNF (text/grammar/json_schema.c). err_path gets the JSON pointer of the
 * keyword a CS_EINVAL names ("#/properties/a/minimum"), malloc'd, may be NULL. ws: the
 * whitespace allowed between tokens as a regex (NULL: none, compact JSON as the OpenAI API
 * writes it). A NULL schema, or {"type": "object"} with nothing else: any JSON object
 * (json_object mode). */
int grammar_json_schema_to_gbnf(const json_t *schema, const char *ws, char **gbnf, char **err_path);

/* ---- the vocabulary as bytes ---- */
typedef struct grammar_vocab grammar_vocab_t;
/* Each token's bytes as the tokenizer decodes it (byte-level BPE: its bytes; SentencePiece:
 * ▁ as a space, <0xNN> as the byte), sorted into a trie. Special tokens are never allowed by
 * a grammar; the EOS ids (eos, n_eos) are allowed where the grammar can end. */
int grammar_vocab_new(const tokenizer_t *t, const int32_t *eos, int n_eos, grammar_vocab_t **out);
/* A vocabulary of n byte strings (toks[i] NULL or lens[i] 0: never allowed), for tests. */
int grammar_vocab_from_bytes(const char *const *toks, const size_t *lens, int n, const int32_t *eos, int n_eos,
                             grammar_vocab_t **out);
void grammar_vocab_free(grammar_vocab_t *v);
int grammar_vocab_size(const grammar_vocab_t *v);
/* token id's bytes (*len of them); NULL for a special token */
const uint8_t *grammar_vocab_bytes(const grammar_vocab_t *v, int32_t id, size_t *len);

/* ---- a matcher: one sequence's place in the grammar ---- */
typedef struct grammar_matcher grammar_matcher_t;
grammar_matcher_t *grammar_matcher_new(const grammar_t *g);   /* NULL: out of memory */
void grammar_matcher_free(grammar_matcher_t *m);
/* Consume bytes: false (and the matcher unchanged) when they leave the grammar. */
bool grammar_matcher_accept_bytes(grammar_matcher_t *m, const uint8_t *b, size_t n);
/* Consume token id (an EOS id: accepted where the grammar can end; it ends the matcher). */
bool grammar_matcher_accept_token(grammar_matcher_t *m, const grammar_vocab_t *v, int32_t id);
bool grammar_matcher_can_end(const grammar_matcher_t *m);     /* the output so far is complete */
/* complete and nothing can follow: the sequence is over */
bool grammar_matcher_done(const grammar_matcher_t *m);
/* the grammar allowed more than 256 parses of the output at once, or one step (an accept,
 * a mask) followed more than 16M paths through it (a grammar ambiguous enough to make each
 * step slow): the output is refused there (the accept fails, the masks allow nothing) */
bool grammar_matcher_too_ambiguous(const grammar_matcher_t *m);
/* The tokens that keep the output in the grammar: bit id of mask ((vocab + 31) / 32 words)
 * set for each, EOS ids where the grammar can end. Walks the vocabulary's trie once. */
void grammar_matcher_mask(grammar_matcher_t *m, const grammar_vocab_t *v, uint32_t *mask);
/* The same, plainly: each token's bytes run through a copy of the state (the reference the
 * fast path is tested against). */
void grammar_matcher_mask_ref(grammar_matcher_t *m, const grammar_vocab_t *v, uint32_t *mask);

#endif
