package streamrover.flink;

import java.io.Serializable;
import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.List;

import org.apache.flink.api.common.typeinfo.BasicArrayTypeInfo;
import org.apache.flink.api.common.typeinfo.BasicTypeInfo;
import org.apache.flink.api.common.typeinfo.PrimitiveArrayTypeInfo;
import org.apache.flink.api.common.typeinfo.TypeInformation;
import org.apache.flink.api.java.typeutils.RowTypeInfo;
import org.apache.flink.types.Row;
import org.apache.parquet.io.api.Binary;
import org.apache.parquet.io.api.RecordConsumer;
import org.apache.parquet.schema.LogicalTypeAnnotation;
import org.apache.parquet.schema.MessageType;
import org.apache.parquet.schema.PrimitiveType.PrimitiveTypeName;
import org.apache.parquet.schema.Type;
import org.apache.parquet.schema.Types;

/**
 * The records' declared schema (a Flink {@link RowTypeInfo}) as a Parquet schema, and the writing of one
 * {@link Row} into a Parquet record. Fields are optional (a null field is left out); scalar fields are
 * BIGINT, INT, SMALLINT, TINYINT, DOUBLE, FLOAT, BOOLEAN, STRING and BYTES (byte[]), and arrays of the
 * numeric ones become Parquet LISTs (pyarrow reads them as list arrays).
 */
public final class RowSchema implements Serializable {
    private static final long serialVersionUID = 1L;

    /** The kind of one field, by which it is written. */
    enum Kind { LONG, INT, DOUBLE, FLOAT, BOOLEAN, STRING, BYTES }

    private final String[] names;
    private final Kind[] kinds;
    private final boolean[] lists;

    private RowSchema(String[] names, Kind[] kinds, boolean[] lists) {
        this.names = names;
        this.kinds = kinds;
        this.lists = lists;
    }

    /** The schema of a stream of rows; a clear error names a field whose type has no Parquet form here. */
    public static RowSchema of(TypeInformation<?> type) {
        if (!(type instanceof RowTypeInfo)) {
            throw new IllegalArgumentException("streamrover TrainingSink takes a stream of named rows (declare the "
                    + "records' type, e.g. output_type=Types.ROW_NAMED([...], [...])), not " + type);
        }
        RowTypeInfo rows = (RowTypeInfo) type;
        String[] names = rows.getFieldNames();
        Kind[] kinds = new Kind[names.length];
        boolean[] lists = new boolean[names.length];
        for (int i = 0; i < names.length; i++) {
            TypeInformation<?> field = rows.getTypeAt(i);
            TypeInformation<?> element = null;
            if (field instanceof BasicArrayTypeInfo) {
                element = ((BasicArrayTypeInfo<?, ?>) field).getComponentInfo();
            } else if (field instanceof PrimitiveArrayTypeInfo && !field.equals(PrimitiveArrayTypeInfo.BYTE_PRIMITIVE_ARRAY_TYPE_INFO)) {
                element = ((PrimitiveArrayTypeInfo<?>) field).getComponentType();
            }
            lists[i] = element != null;
            Kind kind = kindOf(element != null ? element : field);
            if (kind == null || (lists[i] && (kind == Kind.STRING || kind == Kind.BYTES))) {
                throw new IllegalArgumentException("streamrover TrainingSink: field '" + names[i] + "' has type " + field
                        + ", which it cannot stage as Parquet (use BIGINT, INT, DOUBLE, FLOAT, BOOLEAN, STRING, BYTES "
                        + "or an array of a numeric type)");
            }
            kinds[i] = kind;
        }
        return new RowSchema(names, kinds, lists);
    }

    private static Kind kindOf(TypeInformation<?> t) {
        if (t.equals(BasicTypeInfo.LONG_TYPE_INFO)) return Kind.LONG;
        if (t.equals(BasicTypeInfo.INT_TYPE_INFO) || t.equals(BasicTypeInfo.SHORT_TYPE_INFO)
                || t.equals(BasicTypeInfo.BYTE_TYPE_INFO)) return Kind.INT;
        if (t.equals(BasicTypeInfo.DOUBLE_TYPE_INFO)) return Kind.DOUBLE;
        if (t.equals(BasicTypeInfo.FLOAT_TYPE_INFO)) return Kind.FLOAT;
        if (t.equals(BasicTypeInfo.BOOLEAN_TYPE_INFO)) return Kind.BOOLEAN;
        if (t.equals(BasicTypeInfo.STRING_TYPE_INFO)) return Kind.STRING;
        if (t.equals(PrimitiveArrayTypeInfo.BYTE_PRIMITIVE_ARRAY_TYPE_INFO)) return Kind.BYTES;
        return null;
    }

    /** The field names, in order. */
    public String[] names() {
        return names.clone();
    }

    /** The top-level STRING and BYTES fields: the columns a dictionary can pay for (numeric ones rarely repeat). */
    public List<String> dictionaryColumns() {
        List<String> out = new ArrayList<>();
        for (int i = 0; i < names.length; i++) {
            if (!lists[i] && (kinds[i] == Kind.STRING || kinds[i] == Kind.BYTES)) out.add(names[i]);
        }
        return out;
    }

    /** The Parquet message type of these rows. */
    public MessageType parquet() {
        List<Type> fields = new ArrayList<>();
        for (int i = 0; i < names.length; i++) {
            Type leaf = primitive(kinds[i], lists[i] ? "element" : names[i]);
            if (lists[i]) {
                fields.add(Types.optionalList().element(leaf).named(names[i]));
            } else {
                fields.add(leaf);
            }
        }
        return new MessageType("record", fields);
    }

    private static Type primitive(Kind kind, String name) {
        switch (kind) {
            case LONG: return Types.optional(PrimitiveTypeName.INT64).named(name);
            case INT: return Types.optional(PrimitiveTypeName.INT32).named(name);
            case DOUBLE: return Types.optional(PrimitiveTypeName.DOUBLE).named(name);
            case FLOAT: return Types.optional(PrimitiveTypeName.FLOAT).named(name);
            case BOOLEAN: return Types.optional(PrimitiveTypeName.BOOLEAN).named(name);
            case STRING: return Types.optional(PrimitiveTypeName.BINARY).as(LogicalTypeAnnotation.stringType()).named(name);
            default: return Types.optional(PrimitiveTypeName.BINARY).named(name);
        }
    }

    /** Writes one row as a record (the consumer's message is started and ended here). */
    void write(Row row, RecordConsumer out) {
        if (row.getArity() != names.length) {
            throw new IllegalArgumentException("streamrover TrainingSink: a row has " + row.getArity()
                    + " fields, the declared schema " + names.length + " (" + String.join(", ", names) + ")");
        }
        out.startMessage();
        for (int i = 0; i < names.length; i++) {
            Object value = row.getField(i);
            if (value == null) continue;
            out.startField(names[i], i);
            if (lists[i]) {
                writeList(kinds[i], value, out);
            } else {
                writeValue(kinds[i], value, out);
            }
            out.endField(names[i], i);
        }
        out.endMessage();
    }

    private static void writeList(Kind kind, Object array, RecordConsumer out) {
        int n = java.lang.reflect.Array.getLength(array);
        out.startGroup();
        if (n > 0) {
            out.startField("list", 0);
            for (int j = 0; j < n; j++) {
                out.startGroup();
                Object v = java.lang.reflect.Array.get(array, j);
                if (v != null) {
                    out.startField("element", 0);
                    writeValue(kind, v, out);
                    out.endField("element", 0);
                }
                out.endGroup();
            }
            out.endField("list", 0);
        }
        out.endGroup();
    }

    private static void writeValue(Kind kind, Object v, RecordConsumer out) {
        switch (kind) {
            case LONG: out.addLong(((Number) v).longValue()); break;
            case INT: out.addInteger(((Number) v).intValue()); break;
            case DOUBLE: out.addDouble(((Number) v).doubleValue()); break;
            case FLOAT: out.addFloat(((Number) v).floatValue()); break;
            case BOOLEAN: out.addBoolean((Boolean) v); break;
            case STRING: out.addBinary(Binary.fromString((String) v)); break;
            default: out.addBinary(Binary.fromConstantByteArray((byte[]) v)); break;
        }
    }
}
