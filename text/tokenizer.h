/* tokenizer.h: Hugging Face tokenizer.json BPE tokenizers, both byte-level (Llama 3,
 * Qwen, GPT-2) and SentencePiece-style with byte fallback (Llama 2, Mistral), with the
 * normalizers, pre-tokenizers (PCRE2 regex split), post-processors and decoders those
 * files use, added/special tokens, and incremental detokenization for streaming.
 * Behaviour matches the `tokenizers` library byte for byte. */
#ifndef CS_TOKENIZER_H
#define CS_TOKENIZER_H

#include "base/common.h"

typedef struct tokenizer tokenizer_t;

/* Load DIR/tokenizer.json and, when present, DIR/tokenizer_config.json (bos/eos,
 * add_bos_token, chat_template). */
int tokenizer_load(const char *dir, tokenizer_t **out);
/* config_path may be NULL */
int tokenizer_load_files(const char *json_path, const char *config_path, tokenizer_t **out);
/* From a GGUF file's tokenizer.* metadata (llama.cpp's keys), built as the Hugging Face
 * tokenizer.json a converter would write for it: "gpt2" (byte-level BPE; tokenizer.ggml.pre
 * llama-bpe/llama3, qwen2, smollm-like, gpt-2) and "llama" (SentencePiece BPE, its merges made
 * from the scores). Other models or pre-tokenizers are refused with a message naming them. */
struct gguf;
int tokenizer_load_gguf(const struct gguf *g, tokenizer_t **out);
/* Within text/ (tokenizer_gguf.c): from the trees of tokenizer.json, tokenizer_config.json and
 * generation_config.json already in memory (the last two may be NULL); label names the source
 * in messages. The trees stay the caller's. */
struct json_t;
int tokenizer_load_json(const char *label, struct json_t *root, struct json_t *config,
                        struct json_t *generation, tokenizer_t **out);
void tokenizer_free(tokenizer_t *t);

/* Encode UTF-8 text. add_special applies the post-processor (e.g. prepends <s> or
 * <|begin_of_text|>), as tokenizers' encode(text, add_special_tokens=True). Special and
 * added tokens appearing in the text are always matched (as tokenizers does).
 * *ids is malloc'd; the caller frees it. */
int tokenizer_encode(const tokenizer_t *t, const char *text, size_t len, bool add_special,
                     int32_t **ids, size_t *n_ids);
/* Decode as tokenizers' decode(ids, skip_special_tokens). *out is malloc'd, NUL-terminated. */
int tokenizer_decode(const tokenizer_t *t, const int32_t *ids, size_t n, bool skip_special,
                     char **out, size_t *out_len);

/* The bytes token id stands for inside a text (as the tail of a longer decode: a leading
 * space kept, byte tokens and partial UTF-8 as raw bytes, not U+FFFD). *out malloc'd. */
int tokenizer_token_bytes(const tokenizer_t *t, int32_t id, char **out, size_t *out_len);
int tokenizer_vocab_size(const tokenizer_t *t);      /* highest id + 1, added tokens included */
const char *tokenizer_id_to_token(const tokenizer_t *t, int32_t id); /* raw vocab string or NULL */
int32_t tokenizer_token_to_id(const tokenizer_t *t, const char *token); /* -1 if absent */
bool tokenizer_is_special(const tokenizer_t *t, int32_t id);
int32_t tokenizer_bos_id(const tokenizer_t *t);     /* -1 if none */
int tokenizer_eos_ids(const tokenizer_t *t, const int32_t **ids); /* returns count */
const char *tokenizer_chat_template(const tokenizer_t *t); /* NULL if none */

/* Incremental detokenizer: feed ids one by one, get the newly completed text. Never emits
 * a partial UTF-8 sequence; the concatenation of all pieces (plus the final flush) equals
 * tokenizer_decode of all ids. */
typedef struct tokenizer_stream tokenizer_stream_t;
tokenizer_stream_t *tokenizer_stream_new(const tokenizer_t *t, bool skip_special);
/* Appends id; *piece (malloc'd, maybe "") is the text that became final. */
int tokenizer_stream_push(tokenizer_stream_t *s, int32_t id, char **piece, size_t *piece_len);
/* Whatever is left (e.g. an incomplete UTF-8 tail rendered as U+FFFD as decode would). */
int tokenizer_stream_flush(tokenizer_stream_t *s, char **piece, size_t *piece_len);
void tokenizer_stream_free(tokenizer_stream_t *s);

#endif
