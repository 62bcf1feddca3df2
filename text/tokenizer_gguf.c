/* tokenizer_gguf.c: the tokenizer of a GGUF file, built from its tokenizer.* metadata, so that
 * a .gguf serves without Hugging Face files. The metadata becomes the tokenizer.json,
 * tokenizer_config.json and generation_config.json trees a converter would write for the model
 * (tools/gguf_to_hf.py's mapping for byte-level "gpt2" vocabularies, transformers'
 * LlamaConverter for SentencePiece "llama" ones, merges made from the scores) and those go
 * through tokenizer.c's parser: one implementation of the algorithms, the one the tests hold
 * to the `tokenizers` library. */
#include "text/tokenizer.h"

#include "base/gguf.h"

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* tokenizer.ggml.token_type values (llama.cpp's llama_token_type) */
enum { TT_NORMAL = 1, TT_UNKNOWN = 2, TT_CONTROL = 3, TT_USER_DEFINED = 4 };

/* tokenizer.ggml.pre values, by the pre-tokenizer Hugging Face files of those models have */
enum pre_kind { PRE_GPT2, PRE_LLAMA3, PRE_QWEN2, PRE_DIGITS };
static const struct {
    const char *name;
    enum pre_kind kind;
} PRE_NAMES[] = {
    {"default", PRE_GPT2},    {"gpt-2", PRE_GPT2},      {"gpt2", PRE_GPT2},
    {"llama-bpe", PRE_LLAMA3}, {"llama3", PRE_LLAMA3},  {"llama-v3", PRE_LLAMA3},
    {"qwen2", PRE_QWEN2},
    {"smollm", PRE_DIGITS},   {"starcoder", PRE_DIGITS}, {"refact", PRE_DIGITS}, {"codeshell", PRE_DIGITS},
};

/* The Split regexes of Llama 3's and Qwen2's tokenizer.json (llama.cpp compiles the same in) */
static const char LLAMA3_RE[] =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
    "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
static const char QWEN2_RE[] =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
    "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

/* Token texts llama.cpp ends generation on wherever a vocabulary has them (its
 * special_eog_ids); Hugging Face models list the same ids in generation_config.json. */
static const char *const EOG_TEXTS[] = {
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>", "<|endoftext|>",
    "<|eom_id|>", "<EOT>", "_<EOT>",
    ("<\xef\xbd\x9c" "end\xe2\x96\x81of\xe2\x96\x81sentence\xef\xbd\x9c>"), /* one text: \x9c stops before 'e' */
    "<end_of_utterance>",
};

typedef struct gvocab {
    const gguf_t *g;
    const char *label; /* the file, for messages */
    uint64_t n;
    const char **tok;  /* (n) the reader's NUL-terminated copies */
    int32_t *type;     /* (n) token_type; NORMAL where the file has none */
    float *score;      /* (n) scores; 0 where the file has none */
    json_t *vocab;     /* {token: id}; a repeated text keeps its last id, as dict(...) does */
} gvocab;

static int gg_oom(void) { return cs_error_set(CS_ENOMEM, "tokenizer: out of memory"); }

/* A numeric array of exactly v->n elements, or none (*data NULL). */
static int numeric_arr(const gvocab *v, const char *key, gguf_type *elem, const void **data) {
    bool bad = false;
    uint64_t n;
    *data = NULL;
    if (!gguf_get_arr(v->g, key, elem, &n, data, &bad)) return bad ? CS_EINVAL : CS_OK;
    if (*elem == GGUF_STRING || *elem == GGUF_ARRAY || *elem == GGUF_BOOL)
        return cs_error_set(CS_EFORMAT, "%s: %s is an array of %s, not of numbers", v->label, key,
                            *elem == GGUF_STRING ? "strings" : *elem == GGUF_BOOL ? "bools" : "arrays");
    if (n != v->n)
        return cs_error_set(CS_EFORMAT, "%s: %s has %llu entries for %llu tokens (tokenizer.ggml.tokens)",
                            v->label, key, (unsigned long long)n, (unsigned long long)v->n);
    return CS_OK;
}

static int read_vocab(gvocab *v) {
    bool bad = false;
    gguf_type elem;
    const void *data;
    if (!gguf_get_arr(v->g, "tokenizer.ggml.tokens", &elem, &v->n, &data, &bad))
        return bad ? CS_EINVAL : cs_error_set(CS_EFORMAT, "%s: no tokenizer.ggml.tokens", v->label);
    if (elem != GGUF_STRING)
        return cs_error_set(CS_EFORMAT, "%s: tokenizer.ggml.tokens is not an array of strings", v->label);
    /* ids are int32 throughout; the bound keeps n * sizeof below from overflowing */
    if (v->n == 0 || v->n >= INT32_MAX / 2)
        return cs_error_set(CS_EFORMAT, "%s: tokenizer.ggml.tokens has %llu tokens", v->label,
                            (unsigned long long)v->n);
    v->tok = malloc(v->n * sizeof *v->tok);
    v->type = malloc(v->n * sizeof *v->type);
    v->score = malloc(v->n * sizeof *v->score);
    v->vocab = json_object();
    if (!v->tok || !v->type || !v->score || !v->vocab) return gg_oom();
    for (uint64_t i = 0; i < v->n; i++) {
        size_t len;
        const char *s = gguf_arr_str(v->g, "tokenizer.ggml.tokens", i, &len);
        if (!s) return cs_error_set(CS_EFORMAT, "%s: tokenizer.ggml.tokens[%llu] unreadable", v->label,
                                    (unsigned long long)i);
        /* tokenizer.json holds JSON strings: texts that are not UTF-8 have no equivalent */
        if (strlen(s) != len || !cs_utf8_valid(s, len))
            return cs_error_set(CS_EFORMAT, "%s: tokenizer.ggml.tokens[%llu] is not NUL-free UTF-8 text",
                                v->label, (unsigned long long)i);
        v->tok[i] = s;
        if (json_object_set_new_nocheck(v->vocab, s, json_integer((json_int_t)i)) < 0) return gg_oom();
    }
    if (json_object_size(v->vocab) != v->n)
        cs_log("tokenizer: %s: %llu token texts repeat; each keeps its last id", v->label,
               (unsigned long long)(v->n - json_object_size(v->vocab)));

    const void *types, *scores;
    gguf_type tel = GGUF_INT32, sel = GGUF_FLOAT32;
    int rc;
    if ((rc = numeric_arr(v, "tokenizer.ggml.token_type", &tel, &types)) < 0 ||
        (rc = numeric_arr(v, "tokenizer.ggml.scores", &sel, &scores)) < 0)
        return rc;
    for (uint64_t i = 0; i < v->n; i++) {
        double t = types ? gguf_arr_num(tel, types, i) : TT_NORMAL;
        v->type[i] = t >= 0 && t <= 255 ? (int32_t)t : -1; /* out of range (or NaN): no type of ours */
        double s = scores ? gguf_arr_num(sel, scores, i) : 0.0;
        v->score[i] = isnan(s) ? -INFINITY : (float)s; /* NaN would make the merge order undefined */
    }
    return CS_OK;
}

static void vocab_free(gvocab *v) {
    free(v->tok);
    free(v->type);
    free(v->score);
    json_decref(v->vocab);
}

static int32_t vocab_id(const gvocab *v, const char *s) {
    json_t *id = json_object_get(v->vocab, s);
    return id ? (int32_t)json_integer_value(id) : -1;
}

#define TOKEN_KEY_BAD (-2)

/* A token id key (tokenizer.ggml.bos_token_id ...): dflt when absent, -1 when past the
 * vocabulary (llama.cpp warns and ignores such ids too), TOKEN_KEY_BAD (cs_error set) when the
 * key holds something else. */
static int32_t token_key(const gvocab *v, const char *key, int32_t dflt) {
    bool bad = false;
    uint32_t id;
    if (!gguf_get_u32(v->g, key, &id, &bad)) return bad ? TOKEN_KEY_BAD : dflt;
    if (id >= v->n) {
        cs_log("tokenizer: %s: %s = %u is past the %llu tokens; ignored", v->label, key, id,
               (unsigned long long)v->n);
        return -1;
    }
    return (int32_t)id;
}

static int bool_key(const gvocab *v, const char *key, bool dflt, bool *out) {
    bool bad = false;
    if (!gguf_get_bool(v->g, key, out, &bad)) {
        if (bad) return CS_EINVAL;
        *out = dflt;
    }
    return CS_OK;
}

/* ---------------------------------------------------------------- merges ---- */

/* "left right" strings, rank = index. Split at the first space after the first byte, as
 * llama.cpp does (a left part may itself be a space); handed on as [left, right] pairs, which
 * tokenizer.json allows for parts holding spaces. */
static int gpt2_merges(const gvocab *v, json_t *merges) {
    bool bad = false;
    gguf_type elem;
    uint64_t n;
    const void *data;
    if (!gguf_get_arr(v->g, "tokenizer.ggml.merges", &elem, &n, &data, &bad))
        return bad ? CS_EINVAL
                   : cs_error_set(CS_EFORMAT, "%s: a \"gpt2\" tokenizer without tokenizer.ggml.merges", v->label);
    if (elem != GGUF_STRING)
        return cs_error_set(CS_EFORMAT, "%s: tokenizer.ggml.merges is not an array of strings", v->label);
    cs_buf_t buf = {0};
    int rc = CS_OK;
    for (uint64_t i = 0; i < n && rc == CS_OK; i++) {
        size_t len;
        const char *m = gguf_arr_str(v->g, "tokenizer.ggml.merges", i, &len);
        const char *sp = m && len > 1 ? memchr(m + 1, ' ', len - 1) : NULL;
        if (!sp || strlen(m) != len || !cs_utf8_valid(m, len)) {
            rc = cs_error_set(CS_EFORMAT, "%s: tokenizer.ggml.merges[%llu] ('%s') is not 'left right'", v->label,
                              (unsigned long long)i, m ? m : "?");
            break;
        }
        size_t ll = (size_t)(sp - m);
        buf.len = 0;
        if (!cs_buf_add(&buf, m, ll) || !cs_buf_add(&buf, "", 1)) { rc = gg_oom(); break; }
        const char *right = sp + 1;
        const char *missing = vocab_id(v, buf.p) < 0 ? buf.p : vocab_id(v, right) < 0 ? right : NULL;
        if (!missing) {
            buf.len = ll; /* left + right, the token the merge makes */
            if (!cs_buf_add(&buf, right, len - ll - 1)) { rc = gg_oom(); break; }
            if (vocab_id(v, buf.p) < 0) missing = buf.p;
        }
        if (missing) {
            rc = cs_error_set(CS_EFORMAT, "%s: tokenizer.ggml.merges[%llu] ('%s') needs '%s', which "
                              "tokenizer.ggml.tokens lacks", v->label, (unsigned long long)i, m, missing);
            break;
        }
        json_t *pair = json_pack("[s#s]", m, (int)ll, right);
        if (!pair || json_array_append_new(merges, pair) < 0) rc = gg_oom();
    }
    cs_buf_free(&buf);
    return rc;
}

typedef struct spm_merge {
    float score; /* of the token the merge makes */
    int32_t id, left, right;
} spm_merge;

/* The order of transformers' SentencePieceExtractor (4.x, which made the Llama and Mistral
 * tokenizer.json files): by the made token's score, highest first; ties in vocabulary order (its
 * sort is stable over the pieces), then by the parts' ids. (5.x breaks score ties by the parts'
 * lengths instead; that changes only which of two overlapping equal-score merges goes first.) */
static int spm_merge_cmp(const void *pa, const void *pb) {
    const spm_merge *a = pa, *b = pb;
    if (a->score != b->score) return a->score > b->score ? -1 : 1;
    if (a->id != b->id) return a->id < b->id ? -1 : 1;
    if (a->left != b->left) return a->left < b->left ? -1 : 1;
    return (a->right > b->right) - (a->right < b->right);
}

/* A SentencePiece BPE model ranks merges by the score of the piece they make; a GGUF keeps the
 * scores, not the merges. As transformers' converter does, every split of every token into two
 * tokens becomes a merge, ranked as above. Split at character boundaries (Python slices
 * strings by code point). */
#define SPM_MAX_PIECE 1024 /* bytes */

static int spm_merges(const gvocab *v, json_t *merges) {
    spm_merge *m = NULL;
    size_t n = 0, cap = 0;
    cs_buf_t left = {0};
    int rc = CS_OK;
    for (uint64_t i = 0; i < v->n && rc == CS_OK; i++) {
        const char *s = v->tok[i];
        size_t len = strlen(s);
        if (vocab_id(v, s) != (int32_t)i) continue; /* a repeated text: its last id stands */
        /* every split costs a copy of the prefix: tokens longer than any real vocabulary's
         * (SentencePiece caps pieces at 16 characters by default) make no merges, so that a
         * hostile file cannot make this quadratic in a token's length */
        if (len > SPM_MAX_PIECE) continue;
        for (size_t k = 1; k < len && rc == CS_OK; k++) {
            if (((unsigned char)s[k] & 0xC0) == 0x80) continue;
            left.len = 0;
            if (!cs_buf_add(&left, s, k) || !cs_buf_add(&left, "", 1)) { rc = gg_oom(); break; }
            int32_t l = vocab_id(v, left.p), r = l >= 0 ? vocab_id(v, s + k) : -1;
            if (r < 0) continue;
            if (n == cap) {
                size_t nc = cap ? 2 * cap : 4096;
                spm_merge *nm = realloc(m, nc * sizeof *m);
                if (!nm) { rc = gg_oom(); break; }
                m = nm;
                cap = nc;
            }
            m[n++] = (spm_merge){v->score[i], (int32_t)i, l, r};
        }
    }
    cs_buf_free(&left);
    if (rc == CS_OK && n) qsort(m, n, sizeof *m, spm_merge_cmp);
    for (size_t i = 0; i < n && rc == CS_OK; i++) {
        json_t *pair = json_pack("[ss]", v->tok[m[i].left], v->tok[m[i].right]);
        if (!pair || json_array_append_new(merges, pair) < 0) rc = gg_oom();
    }
    free(m);
    return rc;
}

/* ---------------------------------------------------------------- the trees ---- */

static json_t *split_pretok(const char *regex) {
    return json_pack("{s:s, s:[{s:s, s:{s:s}, s:s, s:b}, {s:s, s:b, s:b, s:b}]}", "type", "Sequence",
                     "pretokenizers", "type", "Split", "pattern", "Regex", regex, "behavior", "Isolated",
                     "invert", 0, "type", "ByteLevel", "add_prefix_space", 0, "trim_offsets", 1,
                     "use_regex", 0);
}

static json_t *bytelevel(void) {
    return json_pack("{s:s, s:b, s:b, s:b}", "type", "ByteLevel", "add_prefix_space", 0, "trim_offsets", 1,
                     "use_regex", 1);
}

static json_t *gpt2_pretok(enum pre_kind kind) {
    switch (kind) {
    case PRE_LLAMA3: return split_pretok(LLAMA3_RE);
    case PRE_QWEN2: return split_pretok(QWEN2_RE);
    case PRE_DIGITS: /* GPT-2's regex with every digit its own piece */
        return json_pack("{s:s, s:[{s:s, s:b}, o]}", "type", "Sequence", "pretokenizers", "type", "Digits",
                         "individual_digits", 1, bytelevel());
    case PRE_GPT2: break;
    }
    return bytelevel();
}

static json_t *tmpl_special(const char *token, int type_id) {
    return json_pack("{s:{s:s, s:i}}", "SpecialToken", "id", token, "type_id", type_id);
}

static json_t *tmpl_sequence(const char *id, int type_id) {
    return json_pack("{s:{s:s, s:i}}", "Sequence", "id", id, "type_id", type_id);
}

/* TemplateProcessing "[bos] $A [eos]", as LlamaTokenizerFast.update_post_processor writes it;
 * json_null() when neither is added. */
static json_t *post_processor(const gvocab *v, int32_t bos, int32_t eos) {
    if (bos < 0 && eos < 0) return json_null();
    json_t *single = json_array(), *pair = json_array(), *specials = json_object();
    json_t *p = json_pack("{s:s, s:o, s:o, s:o}", "type", "TemplateProcessing", "single", single, "pair", pair,
                          "special_tokens", specials);
    if (!p) return NULL;
    bool ok = true;
    for (int seq = 0; seq < 3; seq++) { /* single: bos A eos; pair: bos A eos bos B eos */
        json_t *arr = seq ? pair : single;
        int type_id = seq == 2;
        if (bos >= 0) ok = ok && json_array_append_new(arr, tmpl_special(v->tok[bos], type_id)) == 0;
        ok = ok && json_array_append_new(arr, tmpl_sequence(seq == 2 ? "B" : "A", type_id)) == 0;
        if (eos >= 0) ok = ok && json_array_append_new(arr, tmpl_special(v->tok[eos], type_id)) == 0;
    }
    int32_t ids[2] = {bos, eos};
    for (int k = 0; k < 2; k++) {
        if (ids[k] < 0) continue;
        const char *t = v->tok[ids[k]];
        ok = ok && json_object_set_new(specials, t, json_pack("{s:s, s:[i], s:[s]}", "id", t, "ids", (int)ids[k],
                                                               "tokens", t)) == 0;
    }
    if (!ok) {
        json_decref(p);
        return NULL;
    }
    return p;
}

/* Control and unknown tokens are special added tokens, user-defined ones plain added tokens,
 * all matched in the text as written (llama.cpp's converter stores them pre-normalized). */
static json_t *added_tokens(const gvocab *v) {
    json_t *a = json_array();
    for (uint64_t i = 0; a && i < v->n; i++) {
        int32_t ty = v->type[i];
        if (ty != TT_UNKNOWN && ty != TT_CONTROL && ty != TT_USER_DEFINED) continue;
        json_t *o = json_pack("{s:I, s:s, s:b, s:b, s:b, s:b, s:b}", "id", (json_int_t)i, "content", v->tok[i],
                              "single_word", 0, "lstrip", 0, "rstrip", 0, "normalized", 0, "special",
                              ty != TT_USER_DEFINED);
        if (!o || json_array_append_new(a, o) < 0) {
            json_decref(a);
            return NULL;
        }
    }
    return a;
}

static int eos_list(const gvocab *v, int32_t eos, json_t *list) {
    static const char *const keys[] = {"tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"};
    if (eos >= 0) json_array_append_new(list, json_integer(eos));
    for (size_t k = 0; k < CS_ARRAY_LEN(keys); k++) {
        int32_t id = token_key(v, keys[k], -1);
        if (id == TOKEN_KEY_BAD) return CS_EINVAL;
        if (id >= 0) json_array_append_new(list, json_integer(id));
    }
    for (size_t k = 0; k < CS_ARRAY_LEN(EOG_TEXTS); k++) {
        int32_t id = vocab_id(v, EOG_TEXTS[k]);
        if (id >= 0) json_array_append_new(list, json_integer(id));
    }
    return CS_OK;
}

static int build(gvocab *v, bool spm, enum pre_kind pre, json_t *root, json_t *cfg, json_t *gen) {
    int32_t unk = spm ? token_key(v, "tokenizer.ggml.unknown_token_id", 0) : -1;
    int32_t bos = token_key(v, "tokenizer.ggml.bos_token_id", -1);
    int32_t eos = token_key(v, "tokenizer.ggml.eos_token_id", -1);
    bool add_bos = false, add_eos = false, add_space = false;
    int rc = unk == TOKEN_KEY_BAD || bos == TOKEN_KEY_BAD || eos == TOKEN_KEY_BAD ? CS_EINVAL : CS_OK;
    /* llama.cpp's defaults: BOS for SentencePiece and Llama 3, not for other byte-level BPEs */
    if (rc == CS_OK) rc = bool_key(v, "tokenizer.ggml.add_bos_token", spm || pre == PRE_LLAMA3, &add_bos);
    if (rc == CS_OK) rc = bool_key(v, "tokenizer.ggml.add_eos_token", false, &add_eos);
    if (rc == CS_OK && spm) rc = bool_key(v, "tokenizer.ggml.add_space_prefix", true, &add_space);
    if (rc < 0) return rc;
    if (add_bos && bos < 0) cs_log("tokenizer: %s: add_bos_token without a bos_token_id; no BOS added", v->label);
    if (add_eos && eos < 0) cs_log("tokenizer: %s: add_eos_token without an eos_token_id; no EOS added", v->label);
    json_t *merges = json_array();
    if (!merges) return gg_oom();
    if ((rc = spm ? spm_merges(v, merges) : gpt2_merges(v, merges)) < 0) {
        json_decref(merges);
        return rc;
    }

    json_t *model = json_pack("{s:s, s:n, s:o, s:n, s:n, s:b, s:b, s:b, s:O, s:o}", "type", "BPE", "dropout",
                              "unk_token", unk >= 0 ? json_string(v->tok[unk]) : json_null(),
                              "continuing_subword_prefix", "end_of_word_suffix", "fuse_unk", spm, "byte_fallback",
                              spm, "ignore_merges", pre == PRE_LLAMA3, "vocab", v->vocab, "merges", merges);
    json_t *norm, *pretok, *dec;
    if (spm) {
        /* LlamaConverter (legacy): "▁" before every piece of text between added tokens, spaces as "▁" */
        json_t *replace = json_pack("{s:s, s:{s:s}, s:s}", "type", "Replace", "pattern", "String", " ", "content",
                                    "\xe2\x96\x81");
        norm = add_space ? json_pack("{s:s, s:[{s:s, s:s}, o]}", "type", "Sequence", "normalizers", "type", "Prepend",
                                     "prepend", "\xe2\x96\x81", replace)
                         : json_pack("{s:s, s:[o]}", "type", "Sequence", "normalizers", replace);
        pretok = json_null();
        dec = json_pack("{s:s, s:[{s:s, s:{s:s}, s:s}, {s:s}, {s:s}]}", "type", "Sequence", "decoders", "type",
                        "Replace", "pattern", "String", "\xe2\x96\x81", "content", " ", "type", "ByteFallback", "type",
                        "Fuse");
        if (dec && add_space)
            json_array_append_new(json_object_get(dec, "decoders"),
                                  json_pack("{s:s, s:s, s:i, s:i}", "type", "Strip", "content", " ", "start", 1,
                                            "stop", 0));
    } else {
        /* Qwen2's tokenizer.json composes to NFC first (llama.cpp does not: there it differs) */
        norm = pre == PRE_QWEN2 ? json_pack("{s:s}", "type", "NFC") : json_null();
        pretok = gpt2_pretok(pre);
        dec = json_pack("{s:s, s:b, s:b, s:b}", "type", "ByteLevel", "add_prefix_space", 1, "trim_offsets", 1,
                        "use_regex", 1);
    }
    static const char *const keys[] = {"version", "added_tokens", "normalizer", "pre_tokenizer",
                                       "post_processor", "decoder", "model"};
    json_t *vals[] = {json_string("1.0"), added_tokens(v), norm, pretok,
                      post_processor(v, add_bos ? bos : -1, add_eos ? eos : -1), dec, model};
    bool ok = true;
    for (size_t k = 0; k < CS_ARRAY_LEN(keys); k++) /* set_new takes each value, so none leaks */
        ok = json_object_set_new(root, keys[k], vals[k]) == 0 && ok;
    if (!ok) return gg_oom();

    if (bos >= 0) json_object_set_new(cfg, "bos_token", json_string(v->tok[bos]));
    if (eos >= 0) json_object_set_new(cfg, "eos_token", json_string(v->tok[eos]));
    json_object_set_new(cfg, "add_bos_token", json_boolean(add_bos));
    json_object_set_new(cfg, "add_eos_token", json_boolean(add_eos));
    bool bad = false;
    const char *tmpl = gguf_get_str(v->g, "tokenizer.chat_template", NULL, &bad);
    if (bad) return CS_EINVAL;
    if (tmpl && json_object_set_new(cfg, "chat_template", json_string(tmpl)) < 0)
        return cs_error_set(CS_EFORMAT, "%s: tokenizer.chat_template is not UTF-8 text", v->label);

    json_t *list = json_array();
    if (!list || json_object_set_new(gen, "eos_token_id", list) < 0) return gg_oom();
    return eos_list(v, eos, list);
}

int tokenizer_load_gguf(const gguf_t *g, tokenizer_t **out) {
    if (!g || !out) return cs_error_set(CS_EINVAL, "tokenizer_load_gguf: bad arguments");
    *out = NULL;
    gvocab v = {.g = g, .label = gguf_path(g)};
    bool bad = false;
    const char *model = gguf_get_str(g, "tokenizer.ggml.model", NULL, &bad);
    if (!model)
        return bad ? CS_EINVAL
                   : cs_error_set(CS_ENOTFOUND, "%s: no tokenizer.ggml.model: the file carries no tokenizer",
                                  v.label);
    bool spm = strcmp(model, "llama") == 0;
    if (!spm && strcmp(model, "gpt2") != 0)
        return cs_error_set(CS_EUNSUPPORTED, "%s: tokenizer.ggml.model '%s' is not supported (only 'gpt2', "
                            "byte-level BPE, and 'llama', SentencePiece BPE)", v.label, model);
    enum pre_kind pre = PRE_GPT2;
    if (!spm) {
        const char *name = gguf_get_str(g, "tokenizer.ggml.pre", NULL, &bad);
        if (bad) return CS_EINVAL;
        if (!name) {
            cs_log("tokenizer: %s: no tokenizer.ggml.pre; using 'default' (GPT-2's), as llama.cpp does", v.label);
            name = "default";
        }
        size_t k = 0;
        while (k < CS_ARRAY_LEN(PRE_NAMES) && strcmp(PRE_NAMES[k].name, name) != 0) k++;
        if (k == CS_ARRAY_LEN(PRE_NAMES))
            return cs_error_set(CS_EUNSUPPORTED, "%s: tokenizer.ggml.pre '%s' is not supported (known: llama-bpe, "
                                "llama3, llama-v3, qwen2, smollm, starcoder, refact, codeshell, gpt-2, default)",
                                v.label, name);
        pre = PRE_NAMES[k].kind;
    }
    json_t *root = json_object(), *cfg = json_object(), *gen = json_object();
    int rc = root && cfg && gen ? read_vocab(&v) : gg_oom();
    if (rc == CS_OK) rc = build(&v, spm, pre, root, cfg, gen);
    if (rc == CS_OK) rc = tokenizer_load_json(v.label, root, cfg, gen, out);
    json_decref(root);
    json_decref(cfg);
    json_decref(gen);
    vocab_free(&v);
    return rc;
}
